"""The mesh between the ranks (`mcrdl.bootstrap._mesh`), in one process: a mesh per rank on
threads, over real sockets. A rank "dies" as a killed process does: its connections close
without a goodbye. The agreement's hard cases are deaths partway through a round: a value
that reached some members only, a decision that reached some members only."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch.distributed as dist

from mcrdl.bootstrap._mesh import Mesh
from mcrdl.core import MCRDLError


@dataclass
class FakeBootstrap:
    """What the mesh needs of a bootstrap: a store, a rank, an address, a timeout."""

    store_: Any
    rank: int
    size: int
    timeout: float = 10.0
    host: str = "127.0.0.1"
    lost: list[tuple[int, str]] = field(default_factory=list)

    def store(self) -> Any:
        return self.store_


def meshes(n: int, timeout: float = 10.0) -> tuple[list[Mesh], list[FakeBootstrap]]:
    """``n`` meshes, made at once (each waits for the lower ranks' addresses)."""
    store = dist.HashStore()
    boots = [FakeBootstrap(store, r, n, timeout) for r in range(n)]
    made: dict[int, Mesh] = {}

    def make(b: FakeBootstrap) -> None:
        made[b.rank] = Mesh(b, 10.0, lambda rank, cause, b=b: b.lost.append((rank, cause)))

    threads = [threading.Thread(target=make, args=(b,)) for b in boots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [made[r] for r in range(n)], boots


def die(mesh: Mesh) -> None:
    """End ``mesh`` as a killed process ends: every connection closed, no goodbye."""
    mesh._closed = True
    mesh._wake.send(b"x")
    mesh._thread.join(5)
    for sock in mesh._socks.values():
        sock.close()


def agree_all(ms: list[Mesh], key: str, ranks: list[int],
              members: list[int]) -> dict[int, dict[int, str] | BaseException]:
    """Each of ``ranks`` agrees at once on ``members``, its value ``v<rank>``."""
    out: dict[int, dict[int, str] | BaseException] = {}

    def run(r: int) -> None:
        try:
            out[r] = ms[r].agree(key, members, f"v{r}", lambda: ())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def close(ms: list[Mesh]) -> None:
    for m in ms:
        if not m._closed:
            m.close()


def test_every_member_gets_every_value_and_a_clean_close_is_no_loss():
    ms, boots = meshes(4)
    try:
        out = agree_all(ms, "k", [0, 1, 2, 3], [0, 1, 2, 3])
        assert all(v == {r: f"v{r}" for r in range(4)} for v in out.values()), out
        # A subset agrees among itself, the others not taking part.
        out = agree_all(ms, "sub", [1, 3], [1, 3])
        assert out == {1: {1: "v1", 3: "v3"}, 3: {1: "v1", 3: "v3"}}
    finally:
        close(ms)
    assert all(not b.lost for b in boots), [b.lost for b in boots]


def test_a_stranger_at_the_listener_is_turned_away():
    """A connection that is not a higher rank of the job (a port scanner, a rank number out
    of range, one said twice) is closed, and the setup goes on."""
    import socket
    import struct

    store = dist.HashStore()
    boots = [FakeBootstrap(store, r, 2) for r in range(2)]
    made: dict[int, Mesh] = {}
    zero = threading.Thread(target=lambda: made.setdefault(0, Mesh(boots[0], 10.0, print)))
    zero.start()
    store.wait(["mcrdl/mesh/1/0"])
    host, port = store.get("mcrdl/mesh/1/0").decode().rsplit(" ", 1)
    strangers = [socket.create_connection((host, int(port))) for _ in range(2)]
    strangers[0].sendall(struct.pack("!I", 7))  # (out of range)
    strangers[1].close()  # (says nothing)
    made[1] = Mesh(boots[1], 10.0, print)
    zero.join(30)
    try:
        out = agree_all(made, "k", [0, 1], [0, 1])
        assert out[0] == out[1] == {0: "v0", 1: "v1"}, out
    finally:
        close(list(made.values()))
        strangers[0].close()


def test_a_death_is_learned_by_every_peer_and_named():
    ms, boots = meshes(3)
    try:
        die(ms[1])
        out = agree_all(ms, "k", [0, 2], [0, 1, 2])
        assert out[0] == out[2] == {0: "v0", 2: "v2"}, out
        for r in (0, 2):
            assert boots[r].lost == [(1, "its connection to this rank closed: its process "
                                         "ended")]
            assert ms[r].lost == {1: boots[r].lost[0][1]}
    finally:
        close(ms)


def _dying_leader(mesh: Mesh, reach: set[int]) -> None:
    """``mesh``'s decisions reach ``reach`` only, and it dies once it decided."""
    send, agree = mesh._send, mesh.agree

    def partial(peer: int, key: str, value: str) -> None:
        if not key.endswith("/decided") or peer in reach:
            send(peer, key, value)

    def then_die(*args: Any) -> dict[int, str]:
        said = agree(*args)
        die(mesh)
        return said

    mesh._send = partial  # type: ignore[method-assign]
    mesh.agree = then_die  # type: ignore[method-assign]


@pytest.mark.parametrize("value_reaches, decision_reaches", [
    # rank 3's value reaches the leader only, whose decision reaches rank 1 only: rank 2
    # must wait for the leader's decision or loss, then take rank 1's (caught: a member
    # that does not wait for every lower one decides its own set).
    ({0}, {1}),
    # rank 3's value reaches ranks 0 and 1, the leader decides for nobody: rank 2 must
    # take rank 1's set over its own (caught: a member that keeps its own).
    ({0, 1}, set()),
])
def test_a_death_partway_through_a_round_leaves_one_answer(value_reaches, decision_reaches):
    ms, _ = meshes(4)
    try:
        for peer in value_reaches:
            ms[3]._send(peer, "k/value", "v3")
        die(ms[3])
        _dying_leader(ms[0], decision_reaches)
        out = agree_all(ms, "k", [0, 1, 2], [0, 1, 2, 3])
        assert out[1] == out[2] == {0: "v0", 1: "v1", 2: "v2", 3: "v3"}, out
    finally:
        close(ms)


def test_a_member_that_finalized_is_not_waited_for():
    ms, boots = meshes(3, timeout=20)
    try:
        ms[1].close()
        t0 = time.monotonic()
        out = agree_all(ms, "k", [0, 2], [0, 1, 2])
        assert out[0] == out[2] == {0: "v0", 2: "v2"}, out
        assert time.monotonic() - t0 < 5
        assert not boots[0].lost and not boots[2].lost  # (a goodbye: no loss)
    finally:
        close(ms)


def test_a_member_cut_off_from_a_lower_one_is_told_it_was_left_out():
    """Ranks 0 and 2 cannot reach each other, rank 1 reaches both: 0 decides {0, 1}, 1
    takes it, and 2, given a set without itself, raises instead of going on with it."""
    import socket

    ms, _ = meshes(3)
    try:
        for a, b in ((0, 2), (2, 0)):
            ms[a]._socks[b].shutdown(socket.SHUT_RDWR)
        while 2 not in ms[0].lost or 0 not in ms[2].lost:
            time.sleep(0.01)
        out = agree_all(ms, "k", [0, 1, 2], [0, 1, 2])
        assert out[0] == out[1] == {0: "v0", 1: "v1"}, out
        assert isinstance(out[2], MCRDLError), out
        assert "the survivors' set [0, 1] leaves this rank out" in str(out[2])
    finally:
        close(ms)


def test_a_member_that_never_takes_part_is_named_after_the_timeout():
    ms, _ = meshes(2, timeout=0.3)
    try:
        out = agree_all(ms, "k", [0], [0, 1])
        assert isinstance(out[0], MCRDLError), out
        assert "rank 1 neither answered within 0.3 s nor is known gone" in str(out[0])
    finally:
        close(ms)
