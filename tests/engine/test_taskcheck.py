"""The task check (``init(check_tasks=True)``): a warning when two asyncio tasks have unnamed
collectives unfinished on one communicator and backend at once, and none otherwise."""

from __future__ import annotations

import asyncio
import warnings

import pytest

from mcrdl import TaskOrderWarning
from mcrdl.front._taskcheck import TaskCheck
from tests.engine.support import finish, submit


@pytest.fixture
def check():
    return TaskCheck()


def run_tasks(*steps):
    """Run each step (a coroutine function) as a task of its own, created in this order."""
    async def main():
        await asyncio.gather(*(asyncio.create_task(step(), name=f"t{i}")
                               for i, step in enumerate(steps)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
    return [w for w in caught if issubclass(w.category, TaskOrderWarning)]


def test_two_tasks_with_unnamed_collectives_unfinished_at_once_warn(engine, mpi, check):
    async def first():
        check(submit(engine, mpi, "allreduce"))
        await asyncio.sleep(0)  # the other task submits while this one's is unfinished

    async def second():
        check(submit(engine, mpi, "allreduce"))

    caught = run_tasks(first, second)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "allreduce from task 't1' reaches communicator world on mpi while allreduce from " \
           "task 't0' is unfinished there" in text
    assert "Pass name= to both" in text
    assert caught[0].filename == __file__  # the line that submitted, not mcrdl's


def test_one_task_a_finished_collective_other_lanes_sends_and_no_task_do_not(
        engine, mpi, gloo, check):
    async def one_task():  # several unfinished at once, all from one task
        check(submit(engine, mpi, "allreduce"))
        check(submit(engine, mpi, "alltoall"))

    assert run_tasks(one_task) == []
    for i in range(len(mpi.started)):
        finish(engine, mpi, i)
    n = len(mpi.started)

    async def finishes_first():
        check(submit(engine, mpi, "allreduce"))
        finish(engine, mpi, n)
        await asyncio.sleep(0)

    async def after_it():
        check(submit(engine, mpi, "allreduce"))

    assert run_tasks(finishes_first, after_it) == []
    finish(engine, mpi, n + 1)

    async def here():
        check(submit(engine, mpi, "allreduce", comm="a"))
        await asyncio.sleep(0)

    async def elsewhere():
        check(submit(engine, mpi, "allreduce", comm="b"))

    async def other_backend():  # a lane of its own on the same communicator
        check(submit(engine, gloo, "allreduce", comm="a"))

    assert run_tasks(here, elsewhere, other_backend) == []

    async def sends():  # point-to-point is matched by peer and tag
        check(submit(engine, mpi, "send", comm="a"))

    assert run_tasks(sends) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(submit(engine, mpi, "allreduce", comm="a"))  # outside any task


def test_once_per_lane(engine, mpi, check):
    async def first():
        check(submit(engine, mpi, "allreduce"))
        check(submit(engine, mpi, "allreduce"))
        await asyncio.sleep(0)

    async def second():
        check(submit(engine, mpi, "allgather"))
        check(submit(engine, mpi, "allreduce"))

    assert len(run_tasks(first, second)) == 1
    assert len(run_tasks(first, second)) == 0  # warned about this lane already


def test_a_warning_made_an_error_has_recorded_the_operation_first(engine, mpi, check):
    """Under a filter that makes its warning an error, the check has recorded the operation
    before it raises (so a third task's collective is still checked against it), and lets
    it go when it finishes. (That the front calls the check after the submission, so that
    the operation runs, is checked at 2 and 4 ranks in tests/multirank/test_named.py.)"""
    futs = []

    async def first():
        futs.append(submit(engine, mpi, "allreduce"))
        check(futs[-1])
        await asyncio.sleep(0)

    async def second():
        futs.append(submit(engine, mpi, "allreduce"))
        with pytest.raises(TaskOrderWarning):
            check(futs[-1])

    async def main():
        await asyncio.gather(asyncio.create_task(first()), asyncio.create_task(second()))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main())
    assert all(f.state in ("PENDING", "ISSUED") for f in futs)
    assert list(check._pending[("world", "mpi")]) == futs
    for i in range(2):
        finish(engine, mpi, i)
        engine.poll()
    assert [f.state for f in futs] == ["DONE", "DONE"]
    assert not check._pending[("world", "mpi")]
