"""Addresses: which network a rank is on, its interfaces, and which of rank 0's addresses
every rank can reach.

Ranks that share a network (one host, one network namespace) talk over loopback. Otherwise
rank 0 listens on each of its interface addresses, every other rank tries to connect to each
of them at once (a real TCP handshake, not a routing-table lookup: a route through a default
gateway can exist to an address nothing answers on), and the first of rank 0's addresses
that every rank reached is the rendezvous. Each rank binds its own sockets (gloo's) to the
local address its connection to rank 0 left from: the interface that reaches rank 0. Nothing
is ever bound to a wildcard address. IPv4 and IPv6 alike: an interface's IPv4 addresses are
offered before its IPv6 ones, and link-local IPv6 addresses (``fe80::/10``, meaningful only
with the interface named) are left out.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import select
import socket
import time

import psutil

__all__ = ["LOOPBACK", "Listeners", "describe_reach", "family", "local_addresses", "net_identity",
           "probe", "resolve_host"]

LOOPBACK = "127.0.0.1"


def net_identity() -> str:
    """What ranks that can reach each other over loopback share: the host (its boot id, or
    its name) and the network namespace. Processes in separate network namespaces of one
    machine (containers, an emulated cluster) share a host name but not a loopback."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return "/".join(parts)


def local_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` of every interface that is up and not loopback, in the
    kernel's interface order: per interface its IPv4 addresses, then its IPv6 ones (not
    link-local)."""
    stats = psutil.net_if_stats()
    out: list[tuple[str, str]] = []
    def index(name: str) -> int:
        try:
            return socket.if_nametoindex(name)
        except OSError:  # gone since
            return 1 << 30

    # psutil gives them in getifaddrs' order: every IPv4 address before any IPv6 one.
    for name, addrs in sorted(psutil.net_if_addrs().items(), key=lambda kv: index(kv[0])):
        st = stats.get(name)
        if st is None or not st.isup or "loopback" in st.flags.split(","):
            continue
        for family in (socket.AF_INET, socket.AF_INET6):
            for a in addrs:
                if a.family == family and not _loopback_or_link_local(a.address):
                    out.append((name, a.address))
    return out


def _loopback_or_link_local(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or ip.is_link_local


def family(address: str) -> socket.AddressFamily:
    """The socket family of an address literal."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _describe(addresses: list[tuple[str, str]]) -> str:
    return ", ".join(f"{name} {addr}" for name, addr in addresses) or "none"


def resolve_host(value: str, what: str = "MCRDL_HOST") -> str:
    """The local address ``value`` names: an interface of this host (``eth0``: its first
    address, IPv4 before IPv6), or one of its addresses (or a name resolving to one).

    Raises:
        ValueError: ``value`` is neither, naming this host's interfaces and addresses.
    """
    mine = local_addresses()
    for name, address in mine:
        if value == name:
            return address
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(value, None)}
    except OSError:
        found = set()
    for addr in sorted(found, key=lambda a: (family(a) == socket.AF_INET6, a)):
        if ipaddress.ip_address(addr).is_loopback or any(a == addr for _, a in mine):
            return addr
    raise ValueError(
        f"{what}={value!r} is neither an interface nor an address of this host"
        f" ({socket.gethostname()}: {_describe(mine)}); each rank binds its own address,"
        f" so name an interface every host has ({what}=eth0) or give each host its own"
        " address, or leave it unset to find the interface that reaches rank 0"
    )


class Listeners:
    """Rank 0's probe sockets: one listening socket on each of its addresses. The kernel
    completes a peer's handshake from the listen backlog, so nobody needs to accept."""

    def __init__(self, addresses: list[tuple[str, str]], backlog: int) -> None:
        self.sockets: list[socket.socket] = []
        self.offers: list[tuple[str, str, int]] = []  # (interface, address, port)
        for name, addr in addresses:
            sock = socket.socket(family(addr), socket.SOCK_STREAM)
            try:
                sock.bind((addr, 0))
                sock.listen(backlog)
            except OSError:
                sock.close()
                continue
            self.sockets.append(sock)
            self.offers.append((name, addr, sock.getsockname()[1]))

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


def probe(offers: list[tuple[str, str, int]], timeout: float) -> list[str | None]:
    """Connect to every ``(interface, address, port)`` at once; for each, the local address
    the connection left from, or None where it failed or did not finish in ``timeout``."""
    result: list[str | None] = [None] * len(offers)
    pending: dict[socket.socket, int] = {}
    for i, (_, addr, port) in enumerate(offers):
        sock = socket.socket(family(addr), socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex((addr, port))
        if code in (0, errno.EINPROGRESS):
            pending[sock] = i
        else:
            sock.close()
    deadline = time.monotonic() + timeout
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, ready, _ = select.select([], list(pending), [], left)
            for sock in ready:
                i = pending.pop(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    result[i] = sock.getsockname()[0]
                sock.close()
    finally:
        for sock in pending:
            sock.close()
    return result


def describe_reach(offers: list[tuple[str, str, int]],
                   reached: list[list[str | None]]) -> str:
    """Which of rank 0's addresses each rank reached, for an error message."""
    lines = [f"rank 0 offered {', '.join(f'{n} {a}' for n, a, _ in offers) or 'no address'}"]
    for rank, row in enumerate(reached):
        if rank == 0:
            continue
        got = [offers[i][1] for i, src in enumerate(row) if src is not None]
        lines.append(f"rank {rank} reached {', '.join(got) if got else 'none of them'}")
    return "; ".join(lines)
