"""CommFuture (``engine._future``): its state, results and callbacks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mcrdl import InvalidStateError
from tests.engine.support import awaited, finish, submit


def test_callbacks_run_once_and_late_ones_at_once(engine, mpi):
    seen = []
    f = submit(engine, mpi, "barrier")
    f.add_done_callback(lambda fut: seen.append(("early", fut.state)))
    finish(engine, mpi, 0)
    engine.poll()
    f.add_done_callback(lambda fut: seen.append(("late", fut.state)))
    assert seen == [("early", "DONE"), ("late", "DONE")]

def test_callbacks_may_submit(engine, mpi):
    out = []
    f = submit(engine, mpi, "barrier")
    f.add_done_callback(lambda _: out.append(submit(engine, mpi, "barrier")))
    finish(engine, mpi, 0)
    assert out and out[0].state == "ISSUED"

def test_result_before_done_is_invalid_state(engine, mpi):
    f = submit(engine, mpi, "barrier")
    with pytest.raises(InvalidStateError, match=r"has not finished; use wait\(\) or await it$"):
        f.result()
    with pytest.raises(InvalidStateError):
        f.exception()


def test_a_callback_that_raises_is_reported_and_reaches_nobody_else(engine, mpi, caplog):
    """asyncio's rule: a done-callback's exception is logged with the future, the other
    callbacks still run, and neither the waiter nor the poller sees it."""
    seen = []
    f = submit(engine, mpi, "barrier", result="ok")
    f.add_done_callback(lambda fut: 1 / 0)
    f.add_done_callback(seen.append)
    mpi.finish(mpi.started[0])
    with caplog.at_level("ERROR", logger="mcrdl"):
        assert f.wait() == "ok"
        f.add_done_callback(lambda fut: [][1])  # late: runs at once, reported the same way
    assert seen == [f]
    assert [r.exc_info[0] for r in caplog.records] == [ZeroDivisionError, IndexError]
    assert all("Exception in done-callback" in r.getMessage() and repr(f) in r.getMessage()
               for r in caplog.records)


class _SignallingLock:
    """The engine's lock, announcing every blocking acquire (so that a test can hold the lock
    and know that another thread now waits for it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.waiting = threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if blocking and not self._lock.acquire(False):
            self.waiting.set()
            return self._lock.acquire(True, timeout)
        return blocking or self._lock.acquire(False)

    def release(self):
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def test_a_callback_registered_while_the_future_settles_is_never_lost(engine, mpi):
    """The interleaving that lost an await's wake-up: another thread settles the future
    between the registering thread's look at its state and its registration. Registration
    waits for the settle (the engine's lock), then runs the callback at once."""
    engine._lock = lock = _SignallingLock()
    f = submit(engine, mpi, "barrier")
    seen = []
    lock.acquire()  # a settle in progress elsewhere
    registrar = threading.Thread(target=f.add_done_callback, args=(seen.append,))
    registrar.start()
    assert lock.waiting.wait(5.0), "add_done_callback did not wait for the settle"
    mpi.finish(mpi.started[0])
    engine._work.extend(engine._tracks[mpi].poll())  # settle, as poll would
    engine._run_work()
    assert f.done() and seen == []
    lock.release()
    registrar.join(5.0)
    assert seen == [f]


def test_cancelling_an_awaiting_task_never_cancels_the_operation(engine, mpi):
    """The peers match the operation whatever the task does: cancelling the task that
    awaits it stops the waiting only."""
    f = submit(engine, mpi, "allreduce", result="buf")

    async def main():
        task = asyncio.ensure_future(awaited(f))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert f.state == "ISSUED"
        mpi.finish(mpi.started[0])
        return await f

    assert asyncio.run(main()) == "buf"
