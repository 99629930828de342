"""Sub-communicators, point to point, program order across backends, asyncio, backend errors.

Runs inside every rank at 2 and 4 ranks; every test holds for any world size.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import mcrdl
from mcrdl import BackendError, ReduceOp

BACKENDS = ["mpi", "gloo"]


def total(n: int) -> float:
    return float(sum(range(1, n + 1)))


# -- split ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_strided(comm, backend):
    sub = comm.split(comm.rank % 2)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert sub.size == len(members) and sub.rank == members.index(comm.rank)
    x = torch.tensor([float(comm.rank)])
    assert sub.allreduce(x, backend=backend).wait().item() == float(sum(members))
    got = sub.allgather(torch.tensor([comm.rank]), backend=backend).wait()
    assert got.tolist() == members
    sub.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_uneven_and_key_order(comm, backend):
    # rank 0 alone; everyone else together, in reverse order of rank
    color = 0 if comm.rank == 0 else 1
    sub = comm.split(color, key=-comm.rank)
    members = [0] if color == 0 else sorted(range(1, comm.size), reverse=True)
    assert (sub.size, sub.rank) == (len(members), members.index(comm.rank))
    got = sub.allgather(torch.tensor([comm.rank]), backend=backend).wait()
    assert got.tolist() == members
    if sub.size > 1:
        x = np.array([comm.rank], dtype=np.int64)
        assert sub.broadcast(x, root=0, backend=backend).wait()[0] == members[0]
    sub.close()


def test_split_opt_out_and_nested(comm):
    sub = comm.split(None if comm.rank == comm.size - 1 else 0)
    if comm.rank == comm.size - 1:
        assert sub is None
        return
    assert sub.size == comm.size - 1
    inner = sub.split(sub.rank // 2)
    assert inner.name.startswith(sub.name + ".")
    x = torch.ones(3)
    for backend in BACKENDS:
        assert inner.allreduce(x.clone(), backend=backend).wait().tolist() == [float(inner.size)] * 3
    inner.close()
    sub.close()


def test_overlapping_communicators_interleaved(comm):
    """Ops on two communicators sharing ranks, interleaved and unwaited, in both backends."""
    a = comm.split(0)
    b = comm.split(comm.rank % 2)
    futs = []
    for i in range(6):
        backend = BACKENDS[i % 2]
        futs.append(a.allreduce(torch.full((4,), 1.0), backend=backend))
        futs.append(b.allreduce(torch.full((4,), 1.0), backend=BACKENDS[(i + 1) % 2]))
    for i, f in enumerate(futs):
        assert f.wait().tolist() == [float((a if i % 2 == 0 else b).size)] * 4
    a.close()
    b.close()


# -- point to point ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_recv_pairs(comm, backend):
    if comm.size % 2:
        pytest.skip("pairs need an even world")
    peer = comm.rank ^ 1
    out = torch.arange(10, dtype=torch.float64) + 100 * comm.rank
    inbox = torch.empty(10, dtype=torch.float64)
    if comm.rank % 2 == 0:
        s = comm.send(out, peer, tag=5, backend=backend)
        r = comm.recv(inbox, peer, tag=6, backend=backend)
    else:
        r = comm.recv(inbox, peer, tag=5, backend=backend)
        s = comm.send(out, peer, tag=6, backend=backend)
    assert s.wait() is None
    assert r.wait() is inbox
    assert inbox.tolist() == (torch.arange(10, dtype=torch.float64) + 100 * peer).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_with_tags_out_of_order(comm, backend):
    """Each rank sends two tagged messages right and receives them from the left, tags swapped."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if right == comm.rank:
        pytest.skip("a ring needs two ranks")
    a = np.full(7, comm.rank, dtype=np.int32)
    b = np.full(3, 10 * comm.rank, dtype=np.int16)
    ra, rb = np.empty(7, dtype=np.int32), np.empty(3, dtype=np.int16)
    futs = [comm.recv(rb, left, tag=2, backend=backend), comm.recv(ra, left, tag=1, backend=backend),
            comm.send(a, right, tag=1, backend=backend), comm.send(b, right, tag=2, backend=backend)]
    for f in reversed(futs):
        f.wait()
    assert (ra == left).all() and (rb == 10 * left).all()


def test_send_recv_bfloat16_and_empty(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    for backend in BACKENDS:
        if comm.rank == 0:
            comm.send(torch.full((5,), 1.5, dtype=torch.bfloat16), 1, backend=backend).wait()
            comm.send(torch.empty(0), 1, tag=1, backend=backend).wait()
        elif comm.rank == 1:
            x = torch.empty(5, dtype=torch.bfloat16)
            assert comm.recv(x, 0, backend=backend).wait().float().tolist() == [1.5] * 5
            assert comm.recv(torch.empty(0), 0, tag=1, backend=backend).wait().numel() == 0


def test_a_short_message_fails_its_mpi_receive_and_the_stream_stays_in_step(comm):
    """MPI completes a receive of a shorter message without an error, the rest of the buffer
    as it was: mcrdl fails it, naming both sizes, and the next message is the next one."""
    if comm.size < 2 or comm.rank > 1:
        return
    if comm.rank == 0:
        comm.send(torch.arange(4.0), 1, tag=3, backend="mpi").wait()
        comm.send(torch.arange(8.0), 1, tag=3, backend="mpi").wait()
        alone = comm.recv(torch.empty(4), 1, tag=4, backend="mpi")
        with pytest.raises(mcrdl.DesyncError, match="got a message of 8 bytes"):
            alone.wait()
        return
    # Both in flight at once (tested together), then one alone (tested by itself).
    short = comm.recv(torch.full((8,), -1.0), 0, tag=3, backend="mpi")
    full = comm.recv(torch.empty(8), 0, tag=3, backend="mpi")
    with pytest.raises(mcrdl.DesyncError, match=r"a receive of 32 bytes from rank 0 \(tag 3\) "
                                                r"got a message of 16 bytes"):
        short.wait()
    assert full.wait().tolist() == list(map(float, range(8)))
    if comm.rank == 1:
        comm.send(torch.arange(2.0), 0, tag=4, backend="mpi").wait()


def test_receives_from_any_source(comm):
    """Rank 0 receives every other rank's message from any source (MPI): each once, its
    data with it; no other receive of that tag while it is unfinished; a receive named
    after it gets the next message of its peer's stream. gloo refuses it, naming MPI."""
    backend = "mpi"
    if comm.size < 2:
        pytest.skip("needs two ranks")
    with pytest.raises(mcrdl.UnsupportedOperationError,
                       match="a receive from any source runs on mpi, into host memory"):
        comm.recv(torch.empty(3), None, tag=9, backend="gloo")
    if comm.rank != 0:  # the second message once rank 0 had every first one
        comm.send(torch.full((3,), float(comm.rank)), 0, tag=9, backend=backend).wait()
        comm.recv(torch.empty(1), 0, tag=11, backend=backend).wait()
        comm.send(torch.full((3,), 10.0 * comm.rank), 0, tag=9, backend=backend).wait()
        if comm.rank == 1:  # (what rank 0's first receive waits for, all along)
            comm.send(torch.full((3,), -1.0), 0, tag=12, backend=backend).wait()
        return
    # Nothing of tag 12 comes before the end: no other receive of that tag meanwhile.
    waiting = comm.recv(torch.empty(3), None, tag=12, backend=backend)
    with pytest.raises(ValueError, match=r"a receive of tag 12 on mpi while receive#\d+ from "
                                         r"any source of that tag is unfinished"):
        comm.recv(torch.empty(3), 1, tag=12, backend=backend)
    got = {}
    for _ in range(comm.size - 1):
        fut = comm.recv(torch.empty(3), None, tag=9, backend=backend)
        data = fut.wait()
        assert fut.source not in got and data.tolist() == [float(fut.source)] * 3
        got[fut.source] = True
    assert sorted(got) == list(range(1, comm.size))
    for peer in range(1, comm.size):
        comm.send(torch.empty(1), peer, tag=11, backend=backend).wait()
    for peer in range(1, comm.size):  # each peer's second message, by name
        assert comm.recv(torch.empty(3), peer, tag=9, backend=backend).wait().tolist() == [
            10.0 * peer] * 3
    assert waiting.wait().tolist() == [-1.0] * 3 and waiting.source == 1


# -- program order across backends ---------------------------------------------------------


def test_mixed_chain_gloo_mpi_gloo(comm):
    """allreduce on gloo -> alltoall on mpi -> broadcast on gloo, on the same buffers, unwaited."""
    n, me = comm.size, comm.rank
    x = torch.arange(4 * n, dtype=torch.float32) + me
    out = torch.empty_like(x)
    f1 = comm.allreduce(x, backend="gloo")
    f2 = comm.alltoall(x, out=out, backend="mpi")
    f3 = comm.broadcast(out, root=n - 1, backend="gloo")
    f4 = comm.allreduce(x, ReduceOp.MAX, backend="mpi")  # x is read by f2: must wait for it
    assert f3.wait() is out and f4.wait() is x
    assert f1.done() and f2.done()  # a dependent finishes only after what it waited for
    # sequential reference
    xs = [np.arange(4 * n, dtype=np.float32) + r for r in range(n)]
    summed = np.sum(xs, axis=0)
    # after step 1 every rank holds `summed`; alltoall of identical buffers gives chunk r of
    # summed from everyone; the broadcast from n-1 then gives rank n-1's view to all.
    chunks = np.split(summed, n)
    ref_out = np.concatenate([chunks[n - 1]] * n)
    assert np.array_equal(out.numpy(), ref_out)
    assert np.array_equal(x.numpy(), summed)


@pytest.mark.parametrize("first,second", [("gloo", "mpi"), ("mpi", "gloo")])
def test_write_after_write_across_backends(comm, first, second):
    x = torch.ones(1000)
    futs = [comm.allreduce(x, backend=first), comm.allreduce(x, backend=second),
            comm.allreduce(x, backend=first)]
    futs[-1].wait()
    assert all(f.done() for f in futs)
    assert x[0].item() == float(comm.size ** 3)


def test_read_then_overwrite_across_backends(comm):
    """A send-like read on one backend, then an in-place write on another (write-after-read)."""
    x = torch.full((8 * comm.size,), float(comm.rank))
    gathered = comm.allgather(x, backend="gloo")  # reads x
    comm.allreduce(x, backend="mpi")  # writes x: must not run before the allgather has read it
    expected = np.repeat(np.arange(comm.size, dtype=np.float32), 8 * comm.size)
    assert np.array_equal(gathered.wait().numpy(), expected)


def test_gloo_depends_on_mpi_while_another_mpi_in_flight(comm):
    a = torch.ones(64)
    b = torch.ones(1 << 16)
    fa = comm.allreduce(a, backend="mpi")
    fb = comm.allreduce(b, backend="mpi")  # independent, in flight meanwhile
    fc = comm.allreduce(a, backend="gloo")  # depends on fa
    assert fc.wait()[0].item() == float(comm.size ** 2)
    assert fb.wait()[0].item() == float(comm.size)
    assert fa.done()


def test_after_edges(comm):
    x = torch.ones(4)
    y = torch.ones(4)
    f1 = comm.allreduce(x, backend="gloo")
    f2 = comm.allreduce(y, backend="mpi", after=[f1])
    assert f2.wait()[0].item() == float(comm.size)
    assert f1.done() and f1.result() is x


def test_random_chains_match_sequential_reference(comm):
    """Many unwaited ops on 3 shared buffers with a random backend each (same on all ranks)."""
    rng = np.random.default_rng(1234)
    n, me = comm.size, comm.rank
    bufs = [np.full(4 * n, me + k, dtype=np.float64) for k in range(3)]
    model = [np.stack([np.full(4 * n, r + k, dtype=np.float64) for r in range(n)]) for k in range(3)]
    futs = []
    for _ in range(30):
        k = int(rng.integers(3))
        backend = BACKENDS[int(rng.integers(2))]
        kind = int(rng.integers(3))
        if kind == 0:
            futs.append(comm.allreduce(bufs[k], backend=backend))
            model[k][:] = model[k].sum(axis=0)
        elif kind == 1:
            root = int(rng.integers(n))
            futs.append(comm.broadcast(bufs[k], root=root, backend=backend))
            model[k][:] = model[k][root]
        else:
            j = (k + 1) % 3
            futs.append(comm.alltoall(bufs[k], out=bufs[j], backend=backend))
            chunks = [np.split(model[k][r], n) for r in range(n)]
            model[j] = np.stack([np.concatenate([chunks[i][r] for i in range(n)]) for r in range(n)])
    for f in futs:
        f.wait()
    for k in range(3):
        assert np.array_equal(bufs[k], model[k][me]), k


# -- asyncio -------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_await_in_asyncio_and_uvloop(comm, loop):
    async def main():
        x = torch.ones(16)
        y = await comm.allreduce(x, backend="mpi")
        z = await comm.allgather(y, backend="gloo")
        futs = [comm.allreduce(torch.ones(4), backend=b) for b in BACKENDS * 3]
        results = await asyncio.gather(*futs)
        return y, z, results

    if loop == "uvloop":
        import uvloop

        y, z, results = uvloop.run(main())
    else:
        y, z, results = asyncio.run(main())
    assert y.tolist() == [float(comm.size)] * 16
    assert z.shape == (16 * comm.size,)
    assert all(r.tolist() == [float(comm.size)] * 4 for r in results)


def test_a_wait_timeout_under_a_millisecond_holds_on_gloo(comm):
    """gloo's timed Work.wait counts whole milliseconds and reads 0 as "no timeout": a lone
    gloo wait whose deadline is under 1 ms away must not block until the operation ends."""
    comm.barrier(backend="mpi").wait()
    if comm.rank == 1:
        time.sleep(1.0)
    fut = comm.allreduce(torch.ones(4), backend="gloo")
    if comm.rank == 0:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            fut.wait(timeout=5e-4)
        assert time.perf_counter() - t0 < 0.5
    assert fut.wait().tolist() == [float(comm.size)] * 4


def test_waiting_in_opposite_orders(comm):
    futs = [comm.allreduce(torch.ones(8), backend=BACKENDS[i % 2]) for i in range(8)]
    order = futs if comm.rank % 2 == 0 else list(reversed(futs))
    for f in order:
        assert f.wait()[0].item() == float(comm.size)


# -- errors inside a backend ---------------------------------------------------------------


def test_backend_error_fails_the_future_and_its_dependants_not_the_process(comm):
    """A truncated MPI receive fails its future with MPI's message; a dependant fails too."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    if comm.rank == 0:
        comm.send(np.arange(5, dtype=np.int32), 1, tag=3, backend="mpi").wait()
        comm.send(np.arange(2, dtype=np.int32), 1, tag=4, backend="mpi").wait()
    elif comm.rank == 1:
        small = np.zeros(2, dtype=np.int32)
        ok = np.zeros(2, dtype=np.int32)
        bad = comm.recv(small, 0, tag=3, backend="mpi")
        good = comm.recv(ok, 0, tag=4, backend="mpi")
        with pytest.raises(BackendError, match=r"^MPI: .*runcat"):
            bad.wait()
        assert good.wait() is ok and ok.tolist() == [0, 1]
    comm.barrier().wait()
    # Alone in flight, the receive is waited for by the lone spin (MPI's test_one).
    if comm.rank == 0:
        comm.send(np.arange(5, dtype=np.int32), 1, tag=5, backend="mpi").wait()
    elif comm.rank == 1:
        lone = comm.recv(np.zeros(2, dtype=np.int32), 0, tag=5, backend="mpi")
        with pytest.raises(BackendError, match=r"^MPI: .*runcat"):
            lone.wait()
    comm.barrier().wait()


def test_engine_stats_count_every_operation_once(comm):
    """k operations on both backends, waited: each counted once as submitted, issued, completed."""
    engine = comm.runtime.engine
    before = engine.stats()
    x = torch.ones(64)
    futs = [comm.allreduce(x, backend="gloo"), comm.allreduce(x, backend="mpi"),
            comm.broadcast(torch.ones(3), root=0, backend="mpi"), comm.barrier(backend="gloo")]
    for f in futs:
        f.wait()
    after = engine.stats()
    assert isinstance(after, mcrdl.EngineStats)
    k = len(futs)
    assert after.submitted - before.submitted == k
    assert after.issued - before.issued == k
    assert after.completed - before.completed == k
    assert (after.failed, after.cancelled) == (before.failed, before.cancelled)
    assert (after.pending, after.in_flight) == (0, 0)
    assert after.polls > before.polls


def test_large_allreduces_in_segments_stay_matched(comm):
    """>= 8 MiB allreduces on mpi run in segments; several in flight with small ones between."""
    n = comm.size
    big = (9 << 20) // 4 + 3  # not a multiple of the segment size
    a = torch.full((big,), float(comm.rank + 1))
    b = np.full((big // 2 + 1,), comm.rank + 1, dtype=np.int64)
    c = torch.full((big,), 2.0)
    small = torch.ones(5)
    futs = [comm.allreduce(a, backend="mpi"), comm.allreduce(small, backend="mpi"),
            comm.allreduce(b, ReduceOp.MAX, backend="mpi"), comm.allreduce(c, backend="mpi"),
            comm.allreduce(a, backend="mpi")]  # depends on the first (same buffer)
    for f in reversed(futs):
        f.wait()
    s = float(sum(range(1, n + 1)))
    assert torch.all(a == s * n).item()
    assert (b == n).all()
    assert torch.all(c == 2.0 * n).item()
    assert small.tolist() == [float(n)] * 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_communicator_cycle(comm, backend):
    """rank0: A then C; rank1: B then A; rank2: C then B (A={0,1}, B={1,2}, C={0,2})."""
    if comm.size < 3:
        pytest.skip("needs three ranks")
    r = comm.rank
    a = comm.split(0 if r in (0, 1) else None)
    b = comm.split(0 if r in (1, 2) else None)
    c = comm.split(0 if r in (0, 2) else None)
    if r > 2:
        return
    order = {0: (a, c), 1: (b, a), 2: (c, b)}[r]
    futs = [g.allreduce(torch.full((4,), float(r + 1)), backend=backend) for g in order]
    got = [f.wait()[0].item() for f in futs]
    assert got == {0: [3.0, 4.0], 1: [5.0, 3.0], 2: [4.0, 5.0]}[r]
    for g in order:
        g.close()


def test_a_recorded_moe_step_replays_at_its_size(comm):
    """alltoallv with exchanged counts, then the expert output back (on gloo, whose given
    counts are checked across the members in an exchange of their own), then a gradient
    allreduce: recorded on every rank, replayed simulated under many timings."""
    from mcrdl.testing import record, replay

    n = comm.size
    tokens = torch.arange(4.0 * n).reshape(2 * n, 2)
    with record(comm) as rec:
        routed = comm.alltoallv(tokens, [2] * n, backend="mpi")
        back = comm.alltoallv(routed.wait() * 2, [2] * n, [2] * n, backend="gloo")
        comm.allreduce(torch.ones(8)).wait()
        back.wait()
    assert [op.kind for op in rec.ops] == ["alltoall", "alltoallv", "allgather", "alltoallv",
                                           "allreduce"]
    assert [op.exchange for op in rec.ops] == [True, False, True, False, False]
    assert replay(rec, size=n, seeds=range(5)) == 5
