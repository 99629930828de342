"""The mesh: a TCP connection between every two ranks, for what a rank's death must not take
away (docs/design.md, rule 9). It is made where the bootstrap's store lives in a rank's
process (mpiexec, torchrun without its agent's store, a given store): there no launcher
outlives the ranks to tell who died, nor hosts a store the survivors could still meet in.

- **Who died.** A process that dies closes its connections (its host's kernel does it, even
  for SIGKILL), so every peer reads the end of its stream at once. A host cut off or down
  says nothing: each connection has the kernel's keep-alive probes and a limit on unanswered
  data (``TCP_USER_TIMEOUT``), so it fails once the host has not answered for
  ``peer_timeout`` seconds. The kernel answers the probes, so a busy process is never taken
  for a dead one. A rank that finalizes says goodbye first: its end of stream is no loss
  (the agreement stops waiting for it). One that ends on an exception it did not catch
  leaves without a goodbye (`mcrdl.front._process`'s exit handler): a loss.
  One thread per rank sleeps in ``select`` over all its connections; nothing is sent while
  nobody dies, and the engine's steps never look at the mesh.
- **The survivors' agreement** (the contract of `mcrdl.bootstrap._agree.Meeting`), without
  any store: every member sends its value to every other and waits for each one's, or its
  loss; then the members, lowest rank first, each decide on the set of values it holds,
  taking the set of the last lower member it heard decide, and send its decision to the
  higher members, waiting for each lower one's decision or its loss (consensus with a
  perfect failure detector, the "hierarchical" algorithm: Cachin, Guerraoui and Rodrigues,
  *Introduction to Reliable and Secure Distributed Programming*, 5.1). Every live member
  decides the set of the lowest live member, which waited for every live member's value.
  A rank the mesh cannot reach counts as gone. Where members are cut off from some of the
  others only, a member may find itself left out of the set it is given (it raises), or
  the next round fail; nothing asks for a majority.
"""

from __future__ import annotations

import datetime
import errno
import json
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from ..core._errors import MCRDLError
from ..core._forever import forever
from ._netaddr import family

if TYPE_CHECKING:
    from ._launch import Bootstrap

__all__ = ["Mesh"]

_LENGTH = struct.Struct("!I")
#: The message a rank sends each peer before it closes the mesh (a clean end, not a loss).
_BYE = "mcrdl/bye"
#: The most seconds one wait for a message lasts before the gone ranks are asked again.
_LOOK = 0.05


class Mesh:
    """This rank's connections to every other rank of ``bootstrap``'s job, made through its
    store.

    ``on_lost(rank, cause)`` is called (from the mesh's thread) for each peer whose process
    is gone; the bootstrap's timeout bounds the setup and each agreement's wait;
    ``peer_timeout`` is how long a peer's host may stay silent (see the module docstring).

    Invariants: the reader thread runs from construction until ``close``; a peer is in
    ``lost`` once its stream ended or failed without its goodbye, and stays there.
    """

    def __init__(self, bootstrap: Bootstrap, peer_timeout: float,
                 on_lost: Callable[[int, str], None]) -> None:
        self.rank = bootstrap.rank
        self.timeout = timeout = bootstrap.timeout
        self._bootstrap = bootstrap
        self.peer_timeout = peer_timeout
        self._on_lost = on_lost
        self._lock = threading.Condition()
        #: Messages not yet taken: (key, sender) -> value.
        self._inbox: dict[tuple[str, int], str] = {}
        #: Keys whose agreement ended here (a late message for one is dropped).
        self._done: set[str] = set()
        self.lost: dict[int, str] = {}
        #: Peers that said goodbye; those whose stream has ended too (they finalized).
        self._bye: set[int] = set()
        self._left: set[int] = set()
        self._socks = _connect(bootstrap.store(), self.rank, bootstrap.size, bootstrap.host,
                               timeout)
        self._send_locks = {peer: threading.Lock() for peer in self._socks}
        for sock in self._socks.values():
            _keep_alive(sock, peer_timeout)
        self._wake, self._woken = socket.socketpair()
        self._closed = False
        self._thread = threading.Thread(target=self._read, name="mcrdl-mesh", daemon=True)
        self._thread.start()

    # -- the reader ------------------------------------------------------------------------

    def _read(self) -> None:
        selector = selectors.DefaultSelector()
        for peer, sock in self._socks.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        selector.register(self._woken, selectors.EVENT_READ, None)
        pending = {peer: bytearray() for peer in self._socks}
        while True:
            for key, _ in selector.select():
                peer = key.data
                if peer is None:  # (close)
                    selector.close()
                    return
                why: OSError | None = None
                try:
                    chunk = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                except OSError as exc:
                    chunk, why = b"", exc
                if not chunk:
                    selector.unregister(key.fileobj)
                    self._ended(peer, why)
                    continue
                buf = pending[peer]
                buf += chunk
                while len(buf) >= _LENGTH.size:
                    (n,) = _LENGTH.unpack_from(buf)
                    if len(buf) < _LENGTH.size + n:
                        break
                    frame = bytes(buf[_LENGTH.size:_LENGTH.size + n])
                    del buf[:_LENGTH.size + n]
                    try:
                        key_, value = json.loads(frame)
                    except ValueError:  # (not mcrdl's: dropped, the connection kept)
                        continue
                    self._deliver(peer, str(key_), str(value))

    def _deliver(self, peer: int, key: str, value: str) -> None:
        with self._lock:
            if key == _BYE:
                self._bye.add(peer)
            elif key.rsplit("/", 1)[0] not in self._done:
                self._inbox[(key, peer)] = value
                self._lock.notify_all()

    def _ended(self, peer: int, why: OSError | None) -> None:
        """``peer``'s stream ended (``why``: how it failed, or None for an end of stream)."""
        with self._lock:
            if self._closed:  # (its own close: the sockets went under the reader)
                return
            if peer in self._bye:
                self._left.add(peer)
                self._lock.notify_all()
                return
            if why is not None and why.errno in _SILENT:
                cause = (f"its host did not answer for {self.peer_timeout:g} s (cut off or "
                         f"down: {why.strerror})")
            else:
                cause = "its connection to this rank closed: its process ended"
            self.lost[peer] = cause
            self._lock.notify_all()
        self._on_lost(peer, cause)

    # -- sending ---------------------------------------------------------------------------

    def _send(self, peer: int, key: str, value: str) -> None:
        data = json.dumps([key, value]).encode()
        with self._send_locks[peer]:
            try:
                self._socks[peer].sendall(_LENGTH.pack(len(data)) + data)
            except OSError:  # (its stream fails in the reader too, which reports the loss)
                pass

    # -- the survivors' agreement ----------------------------------------------------------

    def agree(self, key: str, members: Sequence[int], value: str,
              gone: Callable[[], Collection[int]]) -> dict[int, str]:
        """What each live one of ``members`` (world ranks) said at ``key``, the same on
        every one of them (see the module docstring); ``gone`` gives the ranks known gone by
        other means (a launcher, MPI).

        Raises:
            MCRDLError: a live member did not take part within ``timeout`` seconds, naming
                it.
        """
        others = [m for m in members if m != self.rank]
        for m in others:
            self._send(m, f"{key}/value", value)
        deadline = time.monotonic() + self.timeout
        said = {self.rank: value}
        for m in others:
            heard = self._wait(f"{key}/value", m, gone, deadline)
            if heard is not None:
                said[m] = heard
        for leader in sorted(members):
            if leader == self.rank:
                break
            decided = self._wait(f"{key}/decided", leader, gone, deadline)
            if decided is not None:
                said = {int(m): v for m, v in json.loads(decided).items()}
        decision = json.dumps(said)
        for m in others:
            if m > self.rank:
                self._send(m, f"{key}/decided", decision)
        with self._lock:
            self._done.add(key)
            for stale in [k for k in self._inbox if k[0].rsplit("/", 1)[0] == key]:
                del self._inbox[stale]
        if self.rank not in said:
            raise MCRDLError(
                f"{key}: the survivors' set {sorted(said)} leaves this rank out: a lower "
                f"member could not reach it (its host cut off from some of the others)")
        return dict(sorted(said.items()))

    def _wait(self, key: str, peer: int, gone: Callable[[], Collection[int]],
                  deadline: float) -> str | None:
        """``peer``'s message at ``key``, or None once ``peer`` is known gone or has
        finalized (its goodbye came after its last message)."""
        while True:
            with self._lock:
                if (key, peer) in self._inbox:
                    return self._inbox.pop((key, peer))
                if peer in self.lost or peer in self._left:
                    return None
                self._lock.wait(_LOOK)
            if peer in gone():
                return None
            if time.monotonic() > deadline:
                raise MCRDLError(
                    f"{key}: rank {peer} neither answered within {self.timeout:g} s nor is "
                    f"known gone: each live member must call shrink()")

    def store_for(self, key: str, live: Sequence[int],
                  gone: Callable[[], Collection[int]]) -> Any:
        """A store for one attempt's group creation, where no store outlives every rank:
        served by ``live[0]``, its address agreed like any value.

        Raises:
            MCRDLError: ``live[0]`` is gone before it told where its store is, or before
                this member reached it.
        """
        host = live[0]
        served = self._bootstrap.serve_store() if self.rank == host else None
        said = self.agree(f"{key}/store", live, "" if served is None else served[1], gone)
        if host not in said:
            raise MCRDLError(f"{key}: rank {host}, which was to serve the store, is gone")
        if served is not None:
            # The server lives as long as the process (any survivor may still reach it); the
            # attempt gets a connection of its own, as every other member has.
            _SERVED.append(served[0])
            return served[0].clone()
        try:
            return self._bootstrap.connect_store(said[host])
        except Exception as exc:  # noqa: BLE001 - torch's store errors: the host is gone
            raise MCRDLError(f"{key}: rank {host}'s store at {said[host]} cannot be "
                             f"reached: {str(exc).splitlines()[0] if str(exc) else exc}"
                             ) from exc

    # -- the end ---------------------------------------------------------------------------

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye to every peer (unless not ``goodbye``: they then count this rank as
        gone), stop the reader and close the connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for peer in self._socks:
            if goodbye and peer not in self.lost:
                self._send(peer, _BYE, "")
        self._wake.send(b"x")
        self._thread.join(timeout=5.0)
        for sock in [*self._socks.values(), self._wake, self._woken]:
            sock.close()


#: The stores this process served to the survivors (`Mesh.store_for`).
_SERVED: list[Any] = forever([])
#: The errors of a connection whose peer's host stopped answering.
_SILENT = {errno.ETIMEDOUT, errno.EHOSTUNREACH}


def _connect(store: Any, rank: int, size: int, host: str,
             timeout: float) -> dict[int, socket.socket]:
    """A connection to every other rank: each listens, publishes its address in ``store``,
    connects to every lower rank and accepts every higher one (a connection waits in the
    listener's backlog until it is accepted, so the order cannot deadlock)."""
    # (the meshes each rank made through this store so far: every rank makes as many, so
    # that the keys of each are apart where a store outlives a runtime, as torchrun's agent's)
    prefix = f"mcrdl/mesh/{store.add(f'mcrdl/mesh/made/{rank}', 1)}"
    listener = socket.socket(family(host), socket.SOCK_STREAM)
    socks: dict[int, socket.socket] = {}
    try:
        listener.bind((host, 0))
        listener.listen(size)
        listener.settimeout(timeout)
        store.set(f"{prefix}/{rank}", f"{host} {listener.getsockname()[1]}")
        lower = [f"{prefix}/{r}" for r in range(rank)]
        if lower:
            store.wait(lower, datetime.timedelta(seconds=timeout))
            for r, address in enumerate(store.multi_get(lower)):
                where, port = address.decode().rsplit(" ", 1)
                sock = socket.create_connection((where, int(port)), timeout=timeout)
                sock.sendall(_LENGTH.pack(rank))
                socks[r] = sock
        while len(socks) < size - 1:
            sock, _ = listener.accept()
            sock.settimeout(timeout)
            try:
                (peer,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
            except OSError:
                peer = -1
            if not rank < peer < size or peer in socks:  # (not a rank of this job)
                sock.close()
                continue
            socks[peer] = sock
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    finally:
        listener.close()
    for sock in socks.values():
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a peer closed its mesh connection during the setup")
        data += chunk
    return data


def _keep_alive(sock: socket.socket, seconds: float) -> None:
    """Fail ``sock`` once its peer's host has not answered for about ``seconds``: probes
    while it is idle, a limit on unacknowledged data while it is not (Linux; elsewhere the
    system's keep-alive defaults)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if not hasattr(socket, "TCP_KEEPIDLE"):
        return
    every = max(1, int(seconds) // 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, every)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, every)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(seconds) // every))
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
