"""Debug mode on the real backends (launched with MCRDL_DEBUG=1 at 2 and 4 ranks)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import mcrdl


def test_debug_mode_is_on(comm):
    assert comm.runtime.config.debug
    assert comm._debug is not None


def test_well_formed_collectives_pass_the_check(comm):
    x = torch.ones(8)
    assert comm.allreduce(x, backend="mpi").wait()[0].item() == comm.size
    assert comm.allreduce(x, backend="gloo").wait()[0].item() == comm.size ** 2
    out = comm.alltoallv(torch.arange(comm.size), [1] * comm.size).wait()
    assert out.tolist() == [comm.rank] * comm.size
    sub = comm.split(comm.rank % 2)
    assert sub.allreduce(torch.ones(1)).wait().item() == sub.size
    sub.close()


def test_different_collectives_raise_desync_everywhere(comm):
    x = torch.ones(4)
    if comm.rank == 0:
        fut = comm.broadcast(x, root=0, backend="mpi")
    else:
        fut = comm.allreduce(x, backend="mpi")
    with pytest.raises(mcrdl.DesyncError, match=r"rank 0: broadcast#\d+ float32\[4\] root=0 "
                                                 r"on mpi; rank 1: allreduce#\d+ float32\[4\]"):
        fut.wait()


def test_per_rank_backend_choice_raises_desync_instead_of_hanging(comm):
    backend = "mpi" if comm.rank % 2 == 0 else "gloo"
    with pytest.raises(mcrdl.DesyncError, match=r"on mpi; rank 1: allreduce#\d+ .* on gloo"):
        comm.allreduce(torch.ones(3), backend=backend).wait()


def test_mismatched_sizes_raise_desync_before_gloo_could_abort(comm):
    """gloo kills the process (SIGABRT) on mismatched sizes; the check stops it first."""
    x = torch.ones(4 + comm.rank)
    with pytest.raises(mcrdl.DesyncError, match=r"rank 0: allreduce#\d+ float32\[4\]"):
        comm.allreduce(x, backend="gloo").wait()
    comm.barrier().wait()


def _two_tasks(comm, a_first_on, names=(None, None), sizes=(4, 4), helpers=0):
    """Tasks A (1s) and B (100s) each allreduce ``sizes`` floats; A submits first on the
    ranks in ``a_first_on``, B on the others. The tasks have ``names`` (None: asyncio names
    them "Task-N"); each rank first creates ``helpers`` times its rank helper tasks, which
    shifts asyncio's numbers between ranks. Returns both outcomes."""
    async def task(value, size, first):
        if not first:
            await asyncio.sleep(0.05)
        return await comm.allreduce(torch.full((size,), value), backend="mpi")

    async def main():
        await asyncio.gather(*(asyncio.sleep(0) for _ in range(helpers * comm.rank)))
        a = asyncio.create_task(task(1.0, sizes[0], comm.rank in a_first_on), name=names[0])
        b = asyncio.create_task(task(100.0, sizes[1], comm.rank not in a_first_on),
                                name=names[1])
        return await asyncio.gather(a, b, return_exceptions=True)

    return asyncio.run(main())


def test_collectives_of_two_tasks_in_one_order_everywhere_pass_the_check(comm):
    a, b = _two_tasks(comm, range(comm.size))
    assert a.tolist() == [comm.size] * 4 and b.tolist() == [100.0 * comm.size] * 4


def test_ranks_that_created_different_numbers_of_tasks_pass_the_check(comm):
    """asyncio numbers unnamed tasks in creation order: rank r made 3r helpers first, so
    the same task is "Task-5" on one rank and "Task-8" on another. Debug mode must not
    compare those numbers (it raised DesyncError on this correct program)."""
    a, b = _two_tasks(comm, range(comm.size), helpers=3)
    assert a.tolist() == [comm.size] * 4 and b.tolist() == [100.0 * comm.size] * 4


def test_collectives_of_two_named_tasks_swapped_between_ranks_raise_desync_everywhere(comm):
    """Rule 8: rank 0's task A submits first, the other ranks' task B. Without the task's
    name in the fingerprint, A's allreduce met B's (equal shapes) and every result was
    101.0; the message names the tasks and suggests name=."""
    for outcome in _two_tasks(comm, {0}, names=("A", "B")):
        assert isinstance(outcome, mcrdl.DesyncError), outcome
        text = str(outcome)
        assert "from task 'A'" in text and "from task 'B'" in text, text
        assert "pass name= to each" in text, text
    comm.barrier().wait()


def test_unnamed_tasks_whose_collectives_swap_and_differ_get_desync_suggesting_name(comm):
    for outcome in _two_tasks(comm, {0}, sizes=(4, 5)):
        assert isinstance(outcome, mcrdl.DesyncError), outcome
        text = str(outcome)
        assert "from an unnamed task" in text and "pass name= to each" in text, text
    comm.barrier().wait()


def test_named_collectives_of_tasks_swapped_between_ranks_pass_in_debug_mode(comm):
    """Named, the same swap is no desync: the members match them by name (rule 8), and the
    agreement checks their signatures instead of the fingerprint."""
    async def task(value, name, first):
        if not first:
            await asyncio.sleep(0.05)
        return await comm.allreduce(torch.full((4,), value), backend="mpi", name=name)

    async def main():
        return await asyncio.gather(task(1.0, "A", comm.rank == 0),
                                    task(100.0, "B", comm.rank != 0))

    a, b = asyncio.run(main())
    assert a.tolist() == [comm.size] * 4 and b.tolist() == [100.0 * comm.size] * 4
