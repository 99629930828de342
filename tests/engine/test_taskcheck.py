"""The task check (``init(check_tasks=True)``): a warning when two asyncio tasks have unnamed
collectives unfinished on one communicator at once, and none otherwise."""

from __future__ import annotations

import asyncio
import warnings

import pytest

from mcrdl import TaskOrderWarning
from mcrdl._taskcheck import TaskCheck
from mcrdl.engine import CommFuture
from tests.engine.support import finish, submit


@pytest.fixture
def checked(engine):
    stop = engine.observe(TaskCheck())
    yield engine
    stop()


def run_tasks(*steps):
    """Run each step (a coroutine function) as a task of its own, created in this order."""
    async def main():
        await asyncio.gather(*(asyncio.create_task(step(), name=f"t{i}")
                               for i, step in enumerate(steps)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
    return [w for w in caught if issubclass(w.category, TaskOrderWarning)]


def test_two_tasks_with_unnamed_collectives_unfinished_at_once_warn(checked, mpi):
    async def first():
        submit(checked, mpi, "allreduce")
        await asyncio.sleep(0)  # the other task submits while this one's is unfinished

    async def second():
        submit(checked, mpi, "allreduce")

    caught = run_tasks(first, second)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "allreduce from task 't1' reaches communicator world on mpi while allreduce from " \
           "task 't0' is unfinished there" in text
    assert "Pass name= to both" in text
    assert caught[0].filename.endswith("support.py")  # the submitting call, not mcrdl's


def test_one_task_a_finished_collective_other_lanes_names_and_no_task_do_not(
        checked, mpi, gloo):
    async def one_task():  # several unfinished at once, all from one task
        submit(checked, mpi, "allreduce")
        submit(checked, mpi, "alltoall")

    assert run_tasks(one_task) == []
    for i in range(len(mpi.started)):
        finish(checked, mpi, i)
    n = len(mpi.started)

    async def finishes_first():
        submit(checked, mpi, "allreduce")
        finish(checked, mpi, n)
        await asyncio.sleep(0)

    async def after_it():
        submit(checked, mpi, "allreduce")

    assert run_tasks(finishes_first, after_it) == []
    finish(checked, mpi, n + 1)

    async def here():
        submit(checked, mpi, "allreduce", comm="a")
        await asyncio.sleep(0)

    async def elsewhere():
        submit(checked, mpi, "allreduce", comm="b")

    assert run_tasks(here, elsewhere) == []

    async def other_backend():  # a lane of its own on the same communicator
        submit(checked, gloo, "allreduce", comm="a")

    assert run_tasks(other_backend) == []

    async def named():  # matched by name: no order to get wrong
        group = mpi.world()
        lane = checked.lane(mpi, group, checked.comm("a", group.rank, group.size))
        fut = CommFuture("allreduce", lane, 99, mpi.start_allreduce, ("allreduce",), (), (),
                         None, 0)
        fut.name = "grad"
        checked._observers[0](fut, ())

    async def sends():  # point-to-point is matched by peer and tag
        submit(checked, mpi, "send", comm="a")

    assert run_tasks(named, sends) == []
    submit(checked, mpi, "allreduce", comm="a")  # outside any task
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        submit(checked, mpi, "allreduce", comm="a")


def test_once_per_communicator(checked, mpi):
    async def first():
        submit(checked, mpi, "allreduce")
        submit(checked, mpi, "allreduce")
        await asyncio.sleep(0)

    async def second():
        submit(checked, mpi, "allgather")
        submit(checked, mpi, "allreduce")

    assert len(run_tasks(first, second)) == 1
    assert len(run_tasks(first, second)) == 0  # warned about this communicator already
