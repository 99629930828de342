"""Named regression tests for the classic traps of mixing backends (simulated).

Each runs under several seeds (interleavings). The three-communicator cycle also runs with a
single stream per backend, as frameworks with one communication stream per device do: there
it deadlocks, which is why mcrdl gives every (backend, communicator) lane a stream of its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from mcrdl.testing import SimDeadlock, SimWorld

SEEDS = range(8)


def _cycle(comm):
    """rank0: A then C; rank1: B then A; rank2: C then B (A={0,1}, B={1,2}, C={0,2})."""
    r = comm.rank
    a = comm.split(0 if r in (0, 1) else None)
    b = comm.split(0 if r in (1, 2) else None)
    c = comm.split(0 if r in (0, 2) else None)
    x = np.full(4, float(r + 1))
    order = {0: (a, c), 1: (b, a), 2: (c, b)}[r]
    futs = [g.allreduce(x.copy(), backend="nccl") for g in order]
    return [f.wait().tolist() for f in futs]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("semantics", ["nccl", "mpi"])
def test_three_communicator_cycle_completes(seed, semantics):
    world = SimWorld(3, {"nccl": semantics, "mpi": "mpi"}, seed=seed)
    res = world.run(_cycle)
    assert res[0] == [[3.0] * 4, [4.0] * 4]
    assert res[1] == [[5.0] * 4, [3.0] * 4]
    assert res[2] == [[4.0] * 4, [5.0] * 4]


def test_three_communicator_cycle_deadlocks_on_one_stream_per_device():
    """The harness sees the trap itself: one stream per backend and rank hangs."""
    world = SimWorld(3, {"nccl": "nccl", "mpi": "mpi"}, seed=0, stream="backend")
    with pytest.raises(SimDeadlock, match=r"nccl:world\.\dc0 allreduce #0"):
        world.run(_cycle)


@pytest.mark.parametrize("seed", SEEDS)
def test_ranks_waiting_in_opposite_orders(seed):
    world = SimWorld(4, {"mpi": "mpi", "gloo": "mpi", "nccl": "nccl"}, seed=seed)

    def program(comm):
        x, y, z = (np.full(3, float(comm.rank)) for _ in range(3))
        futs = [comm.allreduce(x, backend="mpi"), comm.allreduce(y, backend="gloo"),
                comm.allreduce(z, backend="nccl")]
        for f in futs if comm.rank % 2 else reversed(futs):
            f.wait()
        return x[0], y[0], z[0]

    assert world.run(program) == [(6.0, 6.0, 6.0)] * 4


@pytest.mark.parametrize("seed", SEEDS)
def test_chain_mpi_gloo_mpi_on_one_buffer(seed):
    world = SimWorld(3, {"mpi": "mpi", "gloo": "mpi"}, seed=seed)

    def program(comm):
        x = np.full(6, float(comm.rank + 1))
        comm.allreduce(x, backend="mpi")
        out = np.empty_like(x)
        comm.alltoall(x, out=out, backend="gloo")
        return comm.allreduce(out, backend="mpi").wait().tolist()

    assert world.run(program) == [[18.0] * 6] * 3


@pytest.mark.parametrize("seed", SEEDS)
def test_gloo_depends_on_mpi_while_another_mpi_is_in_flight(seed):
    world = SimWorld(2, {"mpi": "mpi", "gloo": "mpi"}, seed=seed, max_delay=10)

    def program(comm):
        a, b = np.ones(4), np.ones(8)
        fa = comm.allreduce(a, backend="mpi")
        fb = comm.allreduce(b, backend="mpi")
        fc = comm.broadcast(a, root=1, backend="gloo")  # reads... writes a: after fa
        assert fc.wait() is a and fa.done()
        return a.tolist(), fb.wait().tolist()

    assert world.run(program) == [([2.0] * 4, [2.0] * 8)] * 2


@pytest.mark.parametrize("seed", SEEDS)
def test_receives_posted_before_sends_on_a_windowed_lane(seed):
    """Every rank receives from its left neighbour before it sends to its right one, with a
    collective in flight ahead of them, on a backend that issues one collective per lane at
    a time (``Capabilities.issue_window``, as real MPI does here): sends and receives must
    not wait for a place in that window, or every receive waits for a send behind it."""
    world = SimWorld(3, {"mpi": "windowed"}, seed=seed, max_delay=5)

    def program(comm):
        r, n = comm.rank, comm.size
        x = np.full(4, float(r + 1))
        fa = comm.allreduce(x, backend="mpi")
        inbox = np.zeros(2)
        fr = comm.recv(inbox, (r - 1) % n, tag=0, backend="mpi")
        fs = comm.send(np.full(2, float(r)), (r + 1) % n, tag=0, backend="mpi")
        fb = comm.allreduce(np.ones(3), backend="mpi")
        lane = comm._slots["mpi"].lane
        lane_max = lane.issued if len(lane.pending) == 1 else -1  # fb waits for fa
        fs.wait()
        fr.wait()
        return fa.wait().tolist(), inbox.tolist(), fb.wait().tolist(), lane_max

    res = world.run(program)
    assert [r[:3] for r in res] == [([6.0] * 4, [float((r - 1) % 3)] * 2, [3.0] * 3)
                                    for r in range(3)]
    assert all(r[3] == 1 for r in res)  # fa in flight, fb waiting for its place


def _async_step(comm):
    """Two tasks' named allreduces, then a send and a receive, each awaited."""
    import asyncio

    async def step():
        async def one(x, name):
            return await comm.allreduce(x, name=name)

        sums = await asyncio.gather(one(np.full(4, comm.rank + 1.0), "a"),
                                    one(np.full(4, 10.0 * (comm.rank + 1)), "b"))
        got, peer = np.zeros(2), 1 - comm.rank
        if comm.rank == 0:
            await comm.send(np.ones(2), peer)
            await comm.recv(got, peer)
        else:
            await comm.recv(got, peer)
            await comm.send(np.full(2, 2.0), peer)
        return [s.tolist() for s in sums], got.tolist()

    return asyncio.run(step())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", SEEDS)
def test_an_asyncio_step_runs_in_the_simulated_world(seed):
    """An awaiting task idles as the engine decides, as a waiting thread does: in the
    simulated world it hands control to the scheduler, so the other ranks run (before, its
    event loop kept the scheduler's turn and the world hung)."""
    sums = [[3.0] * 4, [30.0] * 4]
    assert SimWorld(2, seed=seed).run(_async_step) == [(sums, [2.0, 2.0]), (sums, [1.0, 1.0])]
