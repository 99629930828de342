"""Addresses: which network a rank is on, its interfaces, and which of rank 0's addresses
every rank can reach.

Ranks that share a network (one host, one network namespace) talk over loopback. Otherwise
rank 0 listens on each of its interface addresses, every other rank tries to connect to each
of them at once (a real TCP handshake, not a routing-table lookup: a route through a default
gateway can exist to an address nothing answers on), and the first of rank 0's addresses
that every rank reached is the rendezvous. Each rank binds its own sockets (gloo's) to the
local address its connection to rank 0 left from: the interface that reaches rank 0. Nothing
is ever bound to a wildcard address.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import socket
import struct
import time

__all__ = ["LOOPBACK", "Listeners", "describe_reach", "local_addresses", "net_identity", "probe",
           "resolve_host"]

LOOPBACK = "127.0.0.1"
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


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


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))


def local_addresses() -> list[tuple[str, str]]:
    """``(interface, IPv4 address)`` of every interface that is up and not loopback, in the
    kernel's interface order."""
    out: list[tuple[str, str]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                flags = struct.unpack("H", _ioctl(s, _SIOCGIFFLAGS, name)[16:18])[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                addr = socket.inet_ntoa(_ioctl(s, _SIOCGIFADDR, name)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            out.append((name, addr))
    return out


def _describe(addresses: list[tuple[str, str]]) -> str:
    return ", ".join(f"{name} {addr}" for name, addr in addresses) or "none"


def resolve_host(value: str, what: str = "MCRDL_HOST") -> str:
    """The local IPv4 address ``value`` names: an interface of this host (``eth0``), or one
    of its addresses (or a name resolving to one).

    Raises:
        ValueError: ``value`` is neither, naming this host's interfaces and addresses.
    """
    mine = local_addresses()
    for name, address in mine:
        if value == name:
            return address
    try:
        addr: str | None = socket.gethostbyname(value)
    except OSError:
        addr = None
    if addr is not None and (addr.startswith("127.") or any(a == addr for _, a in mine)):
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
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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
