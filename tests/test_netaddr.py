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
    assert resolve_host("::1") == "::1"
    found = local_addresses()
    for name, addr in found:
        # An interface's first address (IPv4 before IPv6): name the address for another.
        assert resolve_host(name) == next(a for n, a in found if n == name)
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


def test_probe_and_listeners_take_ipv6_as_ipv4():
    listeners = Listeners([("lo", "::1"), ("lo", LOOPBACK)], backlog=4)
    try:
        assert [a for _, a, _ in listeners.offers] == ["::1", LOOPBACK]
        assert probe(listeners.offers, timeout=5.0) == ["::1", LOOPBACK]
    finally:
        listeners.close()


def test_local_addresses_keep_ipv6_after_ipv4_and_leave_out_link_local():
    """Every interface's addresses, IPv4 first; link-local IPv6 (fe80::/10) needs its
    interface named, so it is never offered."""
    import ipaddress

    import psutil

    found = local_addresses()
    assert not [a for _, a in found if ipaddress.ip_address(a).is_link_local]
    for name in {n for n, _ in found}:
        mine = [a for n, a in found if n == name]
        kinds = [":" in a for a in mine]
        assert kinds == sorted(kinds), mine  # IPv4 before IPv6
        expected = {a.address for a in psutil.net_if_addrs()[name]
                    if a.family in (socket.AF_INET, socket.AF_INET6)
                    and not ipaddress.ip_address(a.address.split("%")[0]).is_link_local}
        assert set(mine) == expected
        for addr in mine:
            assert resolve_host(addr) == addr
