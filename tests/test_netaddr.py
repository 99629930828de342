"""The address helpers of the bootstrap (mcrdl.bootstrap._netaddr), in one process."""

from __future__ import annotations

import socket

import pytest

from mcrdl.bootstrap._netaddr import (
    LOOPBACK,
    Listeners,
    describe_reach,
    local_addresses,
    probe,
    resolve_host,
)


def test_probe_reports_the_local_address_of_a_listener_it_reached_and_none_elsewhere():
    listeners = Listeners([("lo", LOOPBACK)], backlog=4)
    try:
        closed = socket.socket()
        closed.bind((LOOPBACK, 0))  # bound, never listening: the connection is refused
        dead_port = closed.getsockname()[1]
        offers = [*listeners.offers, ("lo", LOOPBACK, dead_port)]
        assert probe(offers, timeout=5.0) == [LOOPBACK, None]
        closed.close()
    finally:
        listeners.close()


def test_resolve_host_takes_an_interface_name_or_an_own_address():
    assert resolve_host("127.0.0.1") == "127.0.0.1"
    for name, addr in local_addresses():
        assert resolve_host(name) == addr
        assert resolve_host(addr) == addr


def test_resolve_host_refuses_an_address_of_another_host_naming_this_hosts_own():
    with pytest.raises(ValueError, match=r"MCRDL_HOST='198\.18\.255\.254' is neither an "
                                         r"interface nor an address of this host") as info:
        resolve_host("198.18.255.254")
    for name, addr in local_addresses():
        assert f"{name} {addr}" in str(info.value)


def test_describe_reach_names_what_each_rank_reached():
    offers = [("eth0", "10.0.0.1", 1), ("ib0", "10.1.0.1", 2)]
    text = describe_reach(offers, [["10.0.0.1", "10.1.0.1"], [None, "10.1.0.2"], [None, None]])
    assert text == ("rank 0 offered eth0 10.0.0.1, ib0 10.1.0.1; rank 1 reached 10.1.0.1;"
                    " rank 2 reached none of them")
