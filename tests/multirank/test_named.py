"""Named collectives on the real backends (rule 8 of docs/design.md), at 2 and 4 ranks: concurrent
asyncio tasks submit them in orders that differ between ranks, and each gets its own result."""

from __future__ import annotations

import asyncio
import random
import warnings

import numpy as np
import pytest
import torch

import mcrdl


def _opposite_orders(comm, backend):
    """The issue's example: task A allreduces 1s, task B 100s; rank 0's A submits first, the
    other ranks' B does."""
    async def task(value, name, first):
        if not first:
            await asyncio.sleep(0.05)
        return await comm.allreduce(torch.full((4,), value), backend=backend, name=name)

    async def main():
        a = asyncio.create_task(task(1.0, "A", comm.rank == 0))
        b = asyncio.create_task(task(100.0, "B", comm.rank != 0))
        return await asyncio.gather(a, b)

    return asyncio.run(main())


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_tasks_in_opposite_orders_get_their_own_sums(comm, backend):
    a, b = _opposite_orders(comm, backend)
    assert a.tolist() == [comm.size] * 4 and b.tolist() == [100.0 * comm.size] * 4


def test_the_task_check_warns_of_unnamed_collectives_of_two_tasks_in_flight(comm):
    """``init(check_tasks=True)``'s check, on the real backends: rank 0's two tasks each
    submit an unnamed allreduce, and the second finds the first unfinished (the other ranks
    wait at a gloo barrier that rank 0 enters only after both submitted), so rank 0 warns,
    naming both tasks, at the line that submitted; with names, nothing warns. Under a filter
    that makes the warning an error, the second submission raises, and its allreduce runs
    all the same (the peers match it)."""
    from mcrdl.front._taskcheck import TaskCheck

    async def one(t, name):
        try:
            fut = comm.allreduce(t, backend="mpi", name=name)
        except mcrdl.TaskOrderWarning:  # made an error: the operation was submitted anyway
            fut = None
            raised.append(asyncio.current_task().get_name())
        await asyncio.sleep(0)  # the other task submits meanwhile
        if fut is not None:
            await fut
        # (behind it on the lane: done, so is the one whose future the error took)
        await comm.allreduce(torch.ones(1), backend="mpi", name=name and f"{name}+")
        return t

    async def main(names):
        if comm.rank != 0:
            await comm.barrier(backend="gloo")
        a = asyncio.create_task(one(torch.ones(4), names[0]), name="A")
        b = asyncio.create_task(one(torch.full((4,), 100.0), names[1]), name="B")
        await asyncio.sleep(0)  # both submit
        if comm.rank == 0:
            await comm.barrier(backend="gloo")
        return await asyncio.gather(a, b)

    try:
        for names, action in (((None, None), "always"), (("a", "b"), "always"),
                              ((None, None), "error")):
            comm._task_check = TaskCheck()
            raised = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter(action, mcrdl.TaskOrderWarning)
                a, b = asyncio.run(main(names))
            assert a.tolist() == [comm.size] * 4 and b.tolist() == [100.0 * comm.size] * 4
            ours = [w for w in caught if issubclass(w.category, mcrdl.TaskOrderWarning)]
            if action == "error":
                assert raised == ["B"] or comm.rank != 0 and len(raised) <= 1, raised
            elif names[0] is not None or comm.rank != 0:
                assert len(ours) <= (names[0] is None), ours
            else:
                assert len(ours) == 1 and ours[0].filename == __file__, ours
                text = str(ours[0].message)
                assert "allreduce from task 'B'" in text and "task 'A' is unfinished" in text
    finally:
        comm._task_check = None


def test_many_tasks_in_per_rank_orders_over_several_steps(comm):
    """Eight gradient buckets as tasks, each rank starting them in its own random order and
    with its own delays, over mpi and gloo, for several steps (the response cache from the
    second on); an unnamed allreduce of the main flow runs alongside."""
    rng = random.Random(comm.rank)
    buckets = [torch.full((16 * (i + 1),), float(i + 1)) for i in range(8)]

    async def bucket(i):
        await asyncio.sleep(rng.random() * 0.01)
        backend = "mpi" if i % 2 else "gloo"
        await comm.allreduce(buckets[i], backend=backend, name=f"bucket{i}")
        buckets[i].div_(comm.size)

    async def step():
        order = list(range(8))
        rng.shuffle(order)
        tasks = [asyncio.create_task(bucket(i)) for i in order]
        loss = await comm.allreduce(torch.ones(1))
        await asyncio.gather(*tasks)
        return loss

    for _ in range(4):
        assert asyncio.run(step()).item() == comm.size
    for i, t in enumerate(buckets):
        assert t.tolist() == [float(i + 1)] * len(t)
    assert comm._names.keys  # the names were cached


def test_names_used_once_do_not_keep_their_buffers(comm):
    """Names made per step (``f"step{s}/grad{i}"``): once their operations finished, the
    runtime lets their tensors go (a round later at the latest)."""
    import gc
    import weakref

    steps, n = 30, 4
    refs = []
    for s in range(steps):
        bufs = [torch.full((8,), float(i)) for i in range(n)]
        futs = [comm.allreduce(b, name=f"step{s}/grad{i}") for i, b in enumerate(bufs)]
        for f in futs:
            f.wait()
        assert [b[0].item() for b in bufs] == [float(i * comm.size) for i in range(n)]
        refs.extend(weakref.ref(b) for b in bufs)
        del bufs, futs, f
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 2 * n, f"{alive} of {steps * n} named tensors are still alive"


def test_named_operations_keep_their_hazards_and_after_edges(comm):
    """In one task: a named allreduce, then an unnamed broadcast of the same buffer (a
    hazard), then a named allgather after= the broadcast; other tasks run meanwhile."""
    async def chain():
        x = torch.full((4,), float(comm.rank + 1))
        f1 = comm.allreduce(x, name="sum")
        f2 = comm.broadcast(x, root=0)
        f3 = comm.allgather(torch.ones(2), name="gather", after=[f2])
        await f1
        await f2
        return x, await f3

    async def other(k):
        await asyncio.sleep(0.002 * ((comm.rank + k) % 3))
        return await comm.allreduce(torch.ones(3), name=f"other{k}")

    async def main():
        return await asyncio.gather(chain(), *(other(k) for k in range(3)))

    (x, gathered), *others = asyncio.run(main())
    total = comm.size * (comm.size + 1) / 2
    assert x.tolist() == [total] * 4
    assert gathered.tolist() == [1.0] * (2 * comm.size)
    assert all(o.tolist() == [comm.size] * 3 for o in others)


def test_named_operations_on_split_communicators(comm):
    sub = comm.split(comm.rank % 2)
    try:
        async def main():
            names = ["p", "q"] if sub.rank == 0 else ["q", "p"]
            return await asyncio.gather(*(
                sub.allreduce(torch.full((2,), 1.0 if n == "p" else 10.0), name=n)
                for n in names))

        first, second = asyncio.run(main())
        got = {first[0].item(), second[0].item()}
        assert got == {float(sub.size), 10.0 * sub.size}
    finally:
        sub.close()


def test_every_collective_takes_a_name(comm):
    n, r = comm.size, comm.rank
    x = torch.arange(n * 2, dtype=torch.float32) + r
    futs = {
        "bcast": comm.broadcast(torch.full((2,), float(r)), root=0, name="bcast"),
        "reduce": comm.reduce(torch.ones(2), root=0, name="reduce"),
        "gather": comm.gather(torch.ones(1), root=0, name="gather"),
        "scatter": comm.scatter(x, root=0, name="scatter"),
        "rs": comm.reduce_scatter(torch.ones(n), name="rs"),
        "a2a": comm.alltoall(x, name="a2a"),
        "a2av": comm.alltoallv(torch.full((n,), float(r)), [1] * n, name="a2av"),
        "barrier": comm.barrier(name="barrier"),
    }
    out = {k: f.wait() for k, f in futs.items()}
    assert out["bcast"].tolist() == [0.0, 0.0]
    assert out["rs"].tolist() == [float(n)]
    assert out["a2av"].tolist() == [float(i) for i in range(n)]
    if r == 0:
        assert out["reduce"].tolist() == [float(n)] * 2
        assert out["gather"].tolist() == [1.0] * n
    assert out["scatter"].tolist() == [float(2 * r), float(2 * r + 1)]


def test_a_name_in_use_is_refused(comm):
    # The first "twice" waits for a message the next rank sends only after its own second
    # submission: it is surely in flight then (without the gate the background thread could
    # finish it in between, once every peer had submitted it: the test failed ~1 run in 15).
    gate = comm.recv(torch.empty(1), (comm.rank + 1) % comm.size, tag=7)
    x = torch.ones(2)
    fut = comm.allreduce(x, name="twice", after=[gate])
    with pytest.raises(ValueError, match="name 'twice' is in use"):
        comm.allreduce(torch.ones(2), name="twice")
    sent = comm.send(torch.ones(1), (comm.rank - 1) % comm.size, tag=7)
    fut.wait()
    sent.wait()


def test_bad_names_are_refused(comm):
    with pytest.raises(TypeError, match="name must be a str"):
        comm.allreduce(torch.ones(1), name=3)
    with pytest.raises(ValueError, match="non-empty string"):
        comm.allreduce(torch.ones(1), name="")


def test_a_name_a_member_never_submits_fails_naming_it(comm):
    """On a communicator of its own with a short timeout: the last rank never submits "late".
    Every rank fails, within the timeout, with DesyncError or CommBrokenError naming the
    last rank as the one missing "late"."""
    sub = comm.split(0)
    engine = comm.runtime.engine
    saved = engine.timeout
    engine.timeout = 2.0
    try:
        last = sub.size - 1
        fut = sub.allreduce(torch.ones(1), name="late" if sub.rank != last else "solo")
        with pytest.raises((mcrdl.DesyncError, mcrdl.CommBrokenError)) as info:
            fut.wait(timeout=30)
        text = str(info.value)
        assert (f"rank {last} had not submitted it" in text and "'late'" in text
                or "'solo'" in text and "had not submitted it" in text), text
    finally:
        engine.timeout = saved
    np.testing.assert_equal(comm.allreduce(torch.ones(1)).wait().item(), comm.size)


def test_small_named_allreduces_are_fused_and_each_gets_its_own_result(comm, monkeypatch):
    """Agreed in one round, small host allreduces of one lane, dtype and reduce op run as one
    allreduce per ``fusion_bytes`` (made small here, so that groups split); each member still
    gets its own sum, maximum or mean, whatever order its rank submitted it in, torch or
    numpy, whichever dtype."""
    from mcrdl.backends.gloo import GlooBackend
    from mcrdl.backends.mpi import MPIBackend
    from mcrdl.engine import _fusion

    monkeypatch.setattr(comm._names, "fusion_bytes", 96)  # (on every rank alike)
    starts = []
    for cls in (MPIBackend, GlooBackend):
        real = cls.start_allreduce

        def counted(self, group, buf, op, real=real):
            starts.append(buf.nbytes)
            return real(self, group, buf, op)

        monkeypatch.setattr(cls, "start_allreduce", counted)
    n, r = comm.size, comm.rank
    ranks = sum(range(1, n + 1))
    cases = []  # (buffer, name, op, backend, expected)
    for i in range(12):
        cases.append((torch.full((i % 4 + 1,), float(r + 1 + i)), f"f{i}", mcrdl.ReduceOp.SUM,
                      "mpi", float(ranks + n * i)))
    for i in range(6):
        cases.append((np.full(3, r + 1 + i, dtype=np.int64), f"i{i}", mcrdl.ReduceOp.MAX,
                      "mpi", n + i))
    for i in range(6):
        cases.append((torch.full((2,), float(2 * (r + 1)), dtype=torch.bfloat16), f"b{i}",
                      mcrdl.ReduceOp.AVG, "gloo", float(ranks * 2 / n)))
    cases.append((torch.full((_fusion.FUSE_OP_BYTES // 4 + 1,), 1.0), "big", mcrdl.ReduceOp.SUM,
                  "mpi", float(n)))  # above the member size: runs alone
    order = list(range(len(cases)))
    random.Random(r).shuffle(order)
    futs = [comm.allreduce(cases[i][0], cases[i][2], backend=cases[i][3], name=cases[i][1])
            for i in order]
    for f in futs:
        f.wait()
    for buf, name, _op, _backend, expected in cases:
        got = buf.tolist() if isinstance(buf, np.ndarray) else buf.float().tolist()
        assert got == [expected] * len(got), (name, got, expected)
    # One round agreed them all (each member had submitted everything before its first wait):
    # float32 in groups of at most 96 bytes, int64 likewise, bfloat16 in one group; "big" alone.
    assert len(starts) < len(cases) // 2, starts
    assert max(starts) == _fusion.FUSE_OP_BYTES + 4 and sorted(starts)[-2] <= 96, starts


def test_a_large_fused_group_copies_each_member_in_and_out(comm, monkeypatch):
    """64 small named allreduces fuse into one group, whose copies into and out of the fusion
    buffer the MPI backend makes in one call each (two indexed datatypes and a sendrecv to
    itself, `MPIBackend.copy_host`); each member, of 1 to 3 elements, gets its own sum."""
    from mcrdl.backends.mpi import COPY_BY_TYPES, MPIBackend

    batches = []
    real = MPIBackend.copy_host

    def counted(self, copies):
        batches.append(len(copies))
        return real(self, copies)

    monkeypatch.setattr(MPIBackend, "copy_host", counted)
    n, r = comm.size, comm.rank
    bufs = [torch.full((1 + i % 3,), float(r + i)) for i in range(64)]
    order = list(range(len(bufs)))
    random.Random(r).shuffle(order)
    futs = [comm.allreduce(bufs[i], backend="mpi", name=f"g{i}") for i in order]
    for f in futs:
        f.wait()
    for i, buf in enumerate(bufs):
        expected = float(sum(range(n)) + n * i)
        assert buf.tolist() == [expected] * len(buf), (i, buf.tolist(), expected)
    assert max(batches) >= COPY_BY_TYPES, batches


def test_a_task_whose_named_operation_finished_meanwhile_does_not_poll(comm):
    """Tasks each awaiting a named allreduce that the main flow drove to the end while they
    waited for their first loop iteration return at once, with no poll (they did 64 each)."""
    engine = comm.runtime.engine
    xs = [torch.ones(1) for _ in range(16)]
    started = []

    async def one(i):
        fut = comm.allreduce(xs[i], name=f"meanwhile{i}")
        started.append(fut)
        await fut

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(len(xs))]
        await asyncio.sleep(0)  # every task submits, then gives the loop its iteration
        assert len(started) == len(xs)
        for fut in started:
            fut.wait()
        polls = engine._n_polls
        await asyncio.gather(*tasks)
        return engine._n_polls - polls

    assert asyncio.run(main()) < len(xs)
    assert all(x.item() == comm.size for x in xs)
