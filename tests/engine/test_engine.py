"""Engine tests: a manual backend whose operations finish only when the test says so.

No threads, no sleeps: the test drives ``poll_once()`` and asserts on the recorded order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import replace

import pytest

from mcrdl import (
    BackendError,
    CommTimeoutError,
    DependencyFailedError,
    FutureCancelledError,
    InvalidStateError,
    RuntimeFinalizedError,
)
from mcrdl.engine import Engine
from tests.manual_backend import ManualBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(clock: Clock) -> Engine:
    return Engine(background=False, clock=clock)


@pytest.fixture
def mpi() -> ManualBackend:
    return ManualBackend(name="mpi")


@pytest.fixture
def gloo() -> ManualBackend:
    return ManualBackend(name="gloo", self_progressing=True)


def submit(engine, backend, kind, reads=(), writes=(), after=(), comm="world", result=None,
           nbytes=0, hold=None):
    lane = engine.lane(backend, backend.world(), comm)
    seq = submit.seq = getattr(submit, "seq", 0) + 1
    return engine.submit(kind, lane, seq, getattr(backend, f"start_{kind}"), (kind,),
                         tuple(reads), tuple(writes), result, after=after, nbytes=nbytes,
                         hold=hold)


def finish(engine, backend, i, error=None):
    backend.finish(backend.started[i], error)
    engine.poll_once()


A = (0x1000, 0x1100)  # a buffer's byte range
B = (0x2000, 0x2100)
A_HALF = (0x1080, 0x1100)  # overlaps the second half of A


def test_issues_at_submit_when_lane_idle_and_no_dependencies(engine, mpi):
    f = submit(engine, mpi, "allreduce", writes=[A])
    assert f.state == "ISSUED"
    assert mpi.events == [("start", "allreduce")]
    finish(engine, mpi, 0)
    assert f.done() and f.result() is None


def test_independent_ops_on_one_lane_are_all_in_flight(engine, mpi):
    fs = [submit(engine, mpi, "allreduce", writes=[(0x1000 * i, 0x1000 * i + 8)])
          for i in range(1, 4)]
    assert [f.state for f in fs] == ["ISSUED"] * 3


def test_read_after_write_across_backends_waits_for_completion(engine, mpi, gloo):
    w = submit(engine, gloo, "allreduce", writes=[A])
    r = submit(engine, mpi, "alltoall", reads=[A], writes=[B])
    assert r.state == "PENDING" and mpi.started == []
    finish(engine, gloo, 0)
    assert w.state == "DONE" and r.state == "ISSUED"


def test_write_after_read_and_write_after_write(engine, mpi, gloo):
    r = submit(engine, mpi, "send", reads=[A])
    w = submit(engine, gloo, "recv", writes=[A])
    w2 = submit(engine, mpi, "broadcast", writes=[A])
    assert (r.state, w.state, w2.state) == ("ISSUED", "PENDING", "PENDING")
    finish(engine, mpi, 0)
    assert (w.state, w2.state) == ("ISSUED", "PENDING")
    finish(engine, gloo, 0)
    assert w2.state == "ISSUED"


def test_reads_do_not_order_reads(engine, mpi, gloo):
    submit(engine, mpi, "send", reads=[A])
    f = submit(engine, gloo, "send", reads=[A])
    assert f.state == "ISSUED"


def test_partial_overlap_is_a_hazard(engine, mpi, gloo):
    submit(engine, mpi, "recv", writes=[A])
    f = submit(engine, gloo, "send", reads=[A_HALF])
    g = submit(engine, gloo, "send", reads=[(A[1], A[1] + 8)])  # adjacent, not overlapping
    assert f.state == "PENDING"
    assert g.state == "PENDING"  # behind f on the gloo lane: no overtaking
    finish(engine, mpi, 0)
    assert f.state == g.state == "ISSUED"


def test_no_overtaking_in_a_lane(engine, mpi, gloo):
    submit(engine, gloo, "allreduce", writes=[A])
    blocked = submit(engine, mpi, "allreduce", writes=[A])
    ready = submit(engine, mpi, "allreduce", writes=[B])
    assert blocked.state == "PENDING" and ready.state == "PENDING"
    assert mpi.started == []
    finish(engine, gloo, 0)
    assert [r.args for r in mpi.started] == [("allreduce",), ("allreduce",)]
    assert blocked.state == ready.state == "ISSUED"


def test_lanes_of_different_communicators_are_independent(engine, mpi, gloo):
    submit(engine, gloo, "allreduce", writes=[A])
    submit(engine, mpi, "allreduce", writes=[A], comm="world")
    other = submit(engine, mpi, "allreduce", writes=[B], comm="world.1c0")
    assert other.state == "ISSUED"


def test_after_edges(engine, mpi, gloo):
    first = submit(engine, gloo, "barrier")
    second = submit(engine, mpi, "barrier", after=[first])
    assert second.state == "PENDING"
    finish(engine, gloo, 0)
    assert second.state == "ISSUED"


def test_after_a_failed_future_fails_at_once(engine, mpi):
    bad = submit(engine, mpi, "barrier")
    finish(engine, mpi, 0, RuntimeError("boom"))
    f = submit(engine, mpi, "barrier", after=[bad])
    assert f.state == "FAILED"
    with pytest.raises(DependencyFailedError, match=r"depends on barrier#\d+, which failed: boom"):
        f.result()
    assert len(mpi.started) == 1


def test_after_rejects_non_futures(engine, mpi):
    with pytest.raises(TypeError, match=r"^after= takes CommFutures, got int: 3$"):
        submit(engine, mpi, "barrier", after=[3])
    assert engine.stats().submitted == 0


def test_failure_propagates_to_exactly_the_dependants(engine, mpi, gloo):
    src = submit(engine, gloo, "allreduce", writes=[A])
    dep = submit(engine, mpi, "send", reads=[A])
    dep2 = submit(engine, mpi, "broadcast", writes=[B], after=[dep])
    independent = submit(engine, gloo, "allreduce", writes=[(0x9000, 0x9008)])
    lane_successor = submit(engine, gloo, "barrier")
    finish(engine, gloo, 0, RuntimeError("gloo exploded"))
    assert src.state == "FAILED"
    assert isinstance(src.exception(), RuntimeError)
    assert dep.state == "FAILED" and isinstance(dep.exception(), DependencyFailedError)
    assert dep2.state == "FAILED" and isinstance(dep2.exception(), DependencyFailedError)
    assert independent.state == "ISSUED"
    assert lane_successor.state == "ISSUED"
    assert mpi.started == []


def test_backend_start_error_fails_only_that_future(engine, mpi):
    mpi.fail_start = "invalid communicator"
    bad = submit(engine, mpi, "allreduce", writes=[A])
    mpi.fail_start = None
    good = submit(engine, mpi, "allreduce", writes=[B])
    assert bad.state == "FAILED"
    with pytest.raises(BackendError, match=r"failed to start: invalid communicator$"):
        bad.result()
    assert good.state == "ISSUED"


def test_cancel_pending_fails_dependants(engine, mpi, gloo):
    submit(engine, gloo, "allreduce", writes=[A])
    victim = submit(engine, mpi, "allreduce", writes=[A])
    dependant = submit(engine, mpi, "send", reads=[A])
    assert victim.cancel() is True
    assert victim.cancelled() and victim.state == "CANCELLED"
    with pytest.raises(FutureCancelledError):
        victim.result()
    assert isinstance(dependant.exception(), DependencyFailedError)
    assert "cancelled" in str(dependant.exception())


def test_cancel_issued_is_refused_when_backend_cannot(engine, mpi):
    mpi.capabilities = type(mpi.capabilities)(
        ops=mpi.capabilities.ops, dtypes=mpi.capabilities.dtypes, cancel=False)
    f = submit(engine, mpi, "barrier")
    with pytest.raises(InvalidStateError, match=r"cannot cancel .* it was issued already"):
        f.cancel()
    finish(engine, mpi, 0)
    assert f.cancel() is False


def test_cancelled_writer_does_not_hide_an_earlier_writer(engine, mpi, gloo):
    # w1 in flight, w2 waits for it and is cancelled: a later reader must still wait for w1.
    w1 = submit(engine, gloo, "allreduce", writes=[A])
    w2 = submit(engine, mpi, "allreduce", writes=[A])
    w2.cancel()
    reader = submit(engine, mpi, "send", reads=[A], comm="other")
    assert reader.state == "PENDING"
    finish(engine, gloo, 0)
    assert w1.state == "DONE" and reader.state == "ISSUED"


def test_callbacks_run_once_and_late_ones_at_once(engine, mpi):
    seen = []
    f = submit(engine, mpi, "barrier")
    f.add_done_callback(lambda fut: seen.append(("early", fut.state)))
    finish(engine, mpi, 0)
    engine.poll_once()
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


def test_long_chain_settles_without_recursion(engine, mpi):
    class Sync(ManualBackend):
        def _start(self, op, *args):
            return None  # finished during start

    sync = Sync(name="sync")
    head = submit(engine, mpi, "allreduce", writes=[A])
    chain = [submit(engine, sync, "allreduce", writes=[A]) for _ in range(5000)]
    assert chain[-1].state == "PENDING"
    finish(engine, mpi, 0)
    assert head.state == "DONE" and all(f.state == "DONE" for f in chain)
    assert engine.stats().in_flight == 0 and engine.in_flight() == 0


def test_timeout_fails_old_ops_and_dumps_flight_record(clock, mpi):
    dumps = []
    engine = Engine(background=False, clock=clock, timeout=5.0,
                    on_timeout=lambda expired, record: dumps.append((expired, record)))
    done = submit(engine, mpi, "barrier")
    finish(engine, mpi, 0)
    old = submit(engine, mpi, "allreduce", writes=[A])
    clock.now += 3
    young = submit(engine, mpi, "allreduce", writes=[B])
    engine.check_deadlines(clock.now)
    assert old.state == young.state == "ISSUED"
    clock.now += 2.5
    engine.check_deadlines(clock.now)
    assert old.state == "FAILED" and young.state == "ISSUED" and done.state == "DONE"
    err = old.exception()
    assert isinstance(err, CommTimeoutError) and isinstance(err, TimeoutError)
    assert f"allreduce#{old.seq} on lane mpi:world (rank 0 of 1) did not finish within 5 s" in str(err)
    [(expired, record)] = dumps
    assert expired == [old]
    assert "lane mpi:world rank 0/1" in record
    assert f"barrier#{done.seq}" in record and "DONE" in record
    assert f"allreduce#{young.seq}" in record and "ISSUED" in record


def test_wait_timeout_leaves_the_future_in_flight(engine, mpi):
    f = submit(engine, mpi, "barrier")
    with pytest.raises(TimeoutError, match=r"did not finish within 0.001 s; it is still in flight"):
        f.wait(timeout=0.001)
    assert f.state == "ISSUED"
    mpi.finish(mpi.started[0])
    assert f.wait() is None


def test_wait_drives_progress_itself(engine, mpi):
    f = submit(engine, mpi, "allreduce", writes=[A], result="buf")
    mpi.finish(mpi.started[0])  # finished in the backend, not yet seen by the engine
    assert f.state == "ISSUED"
    assert f.wait() == "buf"


def test_await_drives_progress_from_the_loop(engine, mpi):
    f = submit(engine, mpi, "allreduce", writes=[A], result="buf")

    async def main():
        async def finisher():
            for _ in range(3):
                await asyncio.sleep(0)
            mpi.finish(mpi.started[0])

        task = asyncio.ensure_future(finisher())
        value = await f
        await task
        return value

    assert asyncio.run(main()) == "buf"


def test_fail_all_and_close(engine, mpi):
    f = submit(engine, mpi, "barrier")
    g = submit(engine, mpi, "barrier", after=[f])
    n = engine.fail_all(lambda fut: RuntimeFinalizedError(f"finalized before {fut.kind}"))
    assert n == 2
    assert isinstance(f.exception(), RuntimeFinalizedError)
    assert isinstance(g.exception(), (RuntimeFinalizedError, DependencyFailedError))
    engine.close("test")
    with pytest.raises(RuntimeFinalizedError, match=r"^cannot submit barrier: the runtime was finalized \(test\)$"):
        submit(engine, mpi, "barrier")


def test_stats_and_repr(engine, mpi, gloo):
    f = submit(engine, gloo, "allreduce", writes=[A])
    g = submit(engine, mpi, "allreduce", writes=[A])
    assert repr(g) == f"<CommFuture allreduce#{g.seq} PENDING on mpi lane=world rank=0/1 deps=1>"
    s = engine.stats()
    assert (s.submitted, s.issued, s.pending, s.in_flight, s.lanes) == (2, 1, 1, 1, 2)
    finish(engine, gloo, 0)
    finish(engine, mpi, 0)
    s = engine.stats()
    assert (s.completed, s.pending, s.in_flight) == (2, 0, 0)
    assert f.done()


def test_many_in_flight_finishing_out_of_order_are_all_found(engine, mpi):
    """Tracks test a window of requests; those beyond it are found by the rotating window."""
    import random

    futs = [submit(engine, mpi, "allreduce", writes=[(0x10000 + 16 * i, 0x10000 + 16 * i + 8)])
            for i in range(300)]
    order = list(range(300))
    random.Random(7).shuffle(order)
    # finish only requests far from the oldest ones first: only the rotating window sees them
    for i in order[:150]:
        if i >= 64:
            mpi.finish(mpi.started[i])
    polls = 0
    while sum(f.done() for f in futs) < sum(1 for i in order[:150] if i >= 64):
        engine.poll_once()
        polls += 1
        assert polls < 50, "finished requests beyond the first window were never found"
    for req in mpi.started:
        req.done = True
    while not all(f.done() for f in futs):
        engine.poll_once()
        polls += 1
        assert polls < 100
    assert engine.stats().in_flight == 0


def test_poll_policy_idling_is_derived_from_its_settings():
    from mcrdl.engine import PollPolicy

    policy = PollPolicy(yield_seconds=5e-3, sleep_fraction=1 / 32, sleep_max=1e-3)
    assert policy.patience == 5e-3
    assert PollPolicy(oversubscribed=True).patience == 0.0  # never yield-poll oversubscribed
    assert policy.block_patience == 3e-4  # a lone gloo wait blocks sooner than it sleeps...
    assert PollPolicy(oversubscribed=True).block_patience == 0.0
    assert PollPolicy(yield_seconds=1e-4).block_patience == 1e-4  # ...never later
    assert policy.block_after(4) == 3e-4  # a small lone gloo operation is polled first...
    assert policy.block_after((1 << 20) - 1) == 3e-4
    assert policy.block_after(1 << 20) == 0.0  # ...a large one is blocked on at once
    assert policy.nap(0.0) == 1e-4 / 32  # a fresh wait naps a floor, not zero
    assert policy.nap(0.016) == 0.016 / 32  # a fraction of the time waited so far...
    assert policy.nap(10.0) == 1e-3  # ...capped at sleep_max


class _Blocking(ManualBackend):
    """A gloo-like backend (self-progressing, can block in a request): every ``block`` is
    recorded as (thread, timeout, ``probe()``), and the ``finish_on``-th finishes the request."""

    def __init__(self, finish_on=1, probe=lambda: None):
        super().__init__(name="gloo", capabilities=replace(
            ManualBackend.capabilities, self_progressing=True, blocking_wait=True))
        self.finish_on, self.probe = finish_on, probe
        self.blocked = []

    def block(self, request, timeout):
        self.blocked.append((threading.current_thread(), timeout, self.probe()))
        finished = len(self.blocked) == self.finish_on
        if finished:
            self.finish(request)
        return finished


def test_a_lone_wait_on_a_blocking_backend_blocks_after_block_seconds():
    """block_seconds, not yield_seconds, decides when a lone gloo-like wait blocks: with
    yield_seconds at 60 s the wait would otherwise yield-poll past its 5 s timeout."""
    from mcrdl.engine import PollPolicy

    backend = _Blocking()
    engine = Engine(background=False, policy=PollPolicy(yield_seconds=60.0, block_seconds=0.0))
    fut = submit(engine, backend, "allreduce")
    fut.wait(timeout=5.0)
    assert fut.done() and len(backend.blocked) == 1


def test_a_large_lone_wait_on_a_blocking_backend_blocks_at_once():
    """An operation of block_bytes or more is blocked on without polling first: with
    block_seconds and yield_seconds at 60 s, a smaller one would poll past its timeout."""
    from mcrdl.engine import PollPolicy

    backend = _Blocking()
    policy = PollPolicy(yield_seconds=60.0, block_seconds=60.0)
    engine = Engine(background=False, policy=policy)
    fut = submit(engine, backend, "allreduce", nbytes=policy.block_bytes)
    fut.wait(timeout=5.0)
    assert fut.done() and len(backend.blocked) == 1


def test_a_lone_await_on_a_blocking_backend_is_handed_to_a_thread_that_blocks():
    """After await_block_seconds, an awaited lone gloo-like operation is handed to the background
    thread, which blocks in the backend for it (the event loop then sleeps instead of taking
    the CPU from gloo's threads); with yield_seconds at 60 s the await would otherwise poll
    past its 5 s timeout."""
    from mcrdl.engine import PollPolicy

    backend = _Blocking()
    engine = Engine(policy=PollPolicy(yield_seconds=60.0, await_block_seconds=0.0))
    try:
        fut = submit(engine, backend, "allreduce")

        async def main():
            return await asyncio.wait_for(_awaited(fut), 5.0)

        asyncio.run(main())
        assert fut.done()
        assert len(backend.blocked) == 1
        assert backend.blocked[0][0] is not threading.main_thread()
    finally:
        engine.close("test over")


@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_lone_await_on_a_blocking_backend_blocks_in_short_slices_in_the_loop(oversubscribed):
    """From block_seconds until await_block_seconds, an awaited lone gloo-like operation is
    waited for blocking in the loop's own thread (as wait() does: polling takes the CPU from
    gloo's threads, and a hand-off costs ~110 µs), one slice of at most 1 ms at a time, with
    the loop's other tasks running between slices; with yield_seconds at 60 s the await
    would otherwise poll past its 5 s timeout."""
    from mcrdl.engine import PollPolicy

    ticks = [0]
    backend = _Blocking(finish_on=3, probe=lambda: ticks[0])
    engine = Engine(policy=PollPolicy(yield_seconds=60.0, block_seconds=0.0,
                                      await_block_seconds=60.0, oversubscribed=oversubscribed))
    try:
        fut = submit(engine, backend, "allreduce")

        async def ticker():
            while not fut.done():
                ticks[0] += 1
                await asyncio.sleep(0)

        async def main():
            task = asyncio.ensure_future(ticker())
            await asyncio.wait_for(_awaited(fut), 5.0)
            await task

        asyncio.run(main())
        assert fut.done() and len(backend.blocked) == 3
        assert all(thread is threading.main_thread() for thread, _, _ in backend.blocked)
        assert all(timeout <= 1e-3 for _, timeout, _ in backend.blocked)
        first, second, third = (tick for _, _, tick in backend.blocked)
        assert first < second < third  # the other task ran between slices
    finally:
        engine.close("test over")


async def _awaited(fut):
    return await fut


class _Counting(ManualBackend):
    """Its requests finish (or fail) on the n-th test_one; the general test is counted."""

    def __init__(self, after: int, error: BaseException | None = None, **kw):
        super().__init__(**kw)
        self.after, self.error = after, error
        self.one_tests = self.tests = 0

    def test_one(self, request):
        self.one_tests += 1
        if self.one_tests >= self.after:
            if self.error is not None:
                raise self.error
            return True
        return False

    def test(self, requests):
        self.tests += 1
        return super().test(requests)


def test_a_lone_wait_spins_on_its_request_and_settles_it():
    """The only unfinished operation, on a backend that moves data only while polled, is
    waited for by direct tests (Engine.spin_lone), not by polls of every track; a failure
    there fails the future with the backend's error; an oversubscribed node never spins."""
    from mcrdl.engine import PollPolicy

    backend = _Counting(after=5)
    engine = Engine(background=False)
    fut = submit(engine, backend, "allreduce", result="r", nbytes=64)
    seen = []
    fut.add_done_callback(seen.append)
    assert fut.wait(timeout=5.0) == "r"
    assert backend.one_tests == 5 and backend.tests == 0
    assert engine.in_flight() == 0 and fut.lane.track.live == 0
    # Settled in full: counted, its callback run once, and in its lane's flight record.
    assert seen == [fut] and engine.stats().completed == 1
    (record,) = fut.lane.records()
    assert (record.kind, record.seq, record.state, record.nbytes) == ("allreduce", fut.seq,
                                                                      "DONE", 64)
    assert record.t_submit <= record.t_issue <= record.t_done == fut.t_done
    assert fut._args is None and fut._hold is None  # buffers released at once

    # A simulated world progresses only in its idle hook: no lone spin there, and spinning
    # resumes once the hook is gone.
    hooked = _Counting(after=3)
    engine = Engine(background=False)
    engine.idle_hook = lambda: None
    fut = submit(engine, hooked, "allreduce")
    assert engine.spin_lone(fut) is False and hooked.one_tests == 0
    engine.idle_hook = None
    assert engine.spin_lone(fut) is True and hooked.one_tests == 3

    failing = _Counting(after=2, error=BackendError("link down"))
    engine = Engine(background=False)
    fut = submit(engine, failing, "allreduce")
    with pytest.raises(BackendError, match="link down"):
        fut.wait(timeout=5.0)
    assert fut.state == "FAILED" and engine.in_flight() == 0

    slow = _Counting(after=10**9)
    engine = Engine(background=False, policy=PollPolicy(oversubscribed=True))
    fut = submit(engine, slow, "allreduce")
    with pytest.raises(TimeoutError):
        fut.wait(timeout=0.05)
    assert slow.one_tests == 0 and slow.tests > 0


def test_the_contract_default_test_one_reports_a_failed_request():
    """Backend.test_one, for a backend that does not override it, answers through test():
    a request that finished with an error raises it, and the lone spin fails the future."""
    backend = ManualBackend()
    engine = Engine(background=False)
    fut = submit(engine, backend, "allreduce")
    assert backend.test_one(backend.started[0]) is False
    backend.finish(backend.started[0], BackendError("manual link down"))
    with pytest.raises(BackendError, match="manual link down"):
        backend.test_one(backend.started[0])
    with pytest.raises(BackendError, match="manual link down"):
        fut.wait(timeout=5.0)
    assert fut.state == "FAILED" and engine.in_flight() == 0


def test_a_lone_spin_stops_when_another_operation_arrives():
    """A spin is bounded (lone_spins tests), so an operation that another thread submits
    meanwhile is polled soon after (rule 5 of DESIGN.md: the spin cannot interleave with the
    submitter, which waits for the engine's lock or the GIL); and a wait that starts with
    two in flight never spins."""
    backend = _Counting(after=10**9)
    engine = Engine(background=False)
    first = submit(engine, backend, "allreduce")
    go = threading.Event()
    real_test_one = backend.test_one

    def test_one(request):
        if backend.one_tests == 3:
            go.set()
        return real_test_one(request)

    backend.test_one = test_one  # type: ignore[method-assign]

    def arrive():  # another thread submits while the first waiter spins
        go.wait(5.0)
        submit(engine, backend, "allreduce", comm="other")
        for req in backend.started:
            req.done = True

    thread = threading.Thread(target=arrive)
    thread.start()
    assert first.wait(timeout=5.0) is None
    thread.join(5.0)
    assert backend.tests > 0  # the general poll found both
    assert backend.one_tests <= engine.policy.lone_spins
    engine.poll_once()
    assert engine.in_flight() == 0

    # Two in flight from the start: no spin at all.
    backend.one_tests = 0
    a = submit(engine, backend, "allreduce")
    b = submit(engine, backend, "allreduce", comm="other")
    for req in backend.started[-2:]:
        req.done = True
    a.wait(timeout=5.0)
    b.wait(timeout=5.0)
    assert backend.one_tests == 0


def test_hazard_index_forgets_only_the_accesses_it_holds():
    """Removing an operation from a range it never touched leaves that range's accesses
    alone, whether the range holds one access or several."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    index.add("w", (), (A,))
    index.remove("stranger", (), (A,), True)
    assert list(index.conflicts((A,), ())) == ["w"]
    index.add("r", (A,), ())
    index.remove("stranger", (A,), (A,), False)
    assert list(index.conflicts((), (A,))) == ["w", "r"]
    index.remove("w", (), (A,), True)
    index.remove("r", (A,), (), True)
    assert not index.conflicts((A,), (A,)) and not index._regions


def test_hazard_index_keeps_a_lone_access_without_a_region():
    """Most ranges in flight have one access: the index keeps that access itself, with no
    object for the garbage collector, and makes a region once a second access, or a second
    range at the same start, arrives; the answers stay the same."""
    from mcrdl.engine._hazards import HazardIndex, _Region

    index = HazardIndex()
    index.add("w", (), (A,))
    index.add("r", (B,), ())
    assert index._regions == {A[0]: "w", B[0]: "r"}
    assert list(index.conflicts((A_HALF,), ())) == ["w"]  # read after write
    assert list(index.conflicts((B,), ())) == []  # reads never order reads
    assert list(index.conflicts((), (B,))) == ["r"]  # write after read
    index.add("w2", (), (A,))  # a second access to A
    assert isinstance(index._regions[A[0]], _Region) and index._regions[B[0]] == "r"
    assert list(index.conflicts((A,), ())) == ["w2"]  # w2 follows w
    view = (B[0], B[0] + 8)
    index.add("v", (), (view,))  # a second range at B's start
    assert isinstance(index._regions[B[0]], _Region)
    assert list(index.conflicts((), (B,))) == ["r", "v"]
    assert list(index.conflicts((view,), ())) == ["v"]
    for op, reads, writes in (("w", (), (A,)), ("r", (B,), ()), ("w2", (), (A,)),
                              ("v", (), (view,))):
        index.remove(op, reads, writes, True)
    assert not index._regions and not index._lone


def test_an_operation_that_reads_and_writes_a_range_counts_as_writing_it():
    """Its read does not overwrite its write, alone on the range or among others, even once
    the range is broken and conflicts come from every access's own mode."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    index.add("rw", (B,), (B,))  # alone on B
    assert list(index.conflicts((B,), ())) == ["rw"]
    index.add("w", (), (A,))
    index.add("rw2", (A,), (A,))  # A's second access
    index.remove("w", (), (A,), False)  # ended abnormally: A is broken
    assert list(index.conflicts((A,), ())) == ["rw2"]


def test_hazard_index_orders_every_overlap_through_churn():
    """Random adds and in-order-of-readiness removals over a small address pool, long enough
    that dead starts are reused and compacted: every overlapping unfinished access with a
    write on either side is a dependency, directly or through the dependencies it records.
    Some operations fail or are cancelled at any time, taking their dependants with them, as
    the engine fails them: what they leave behind is still ordered."""
    import random

    from mcrdl.engine._hazards import HazardIndex

    rng = random.Random(7)
    index = HazardIndex()
    live: dict[int, tuple[tuple, tuple, set[int]]] = {}  # op -> (reads, writes, deps)

    def ranges() -> tuple[tuple[int, int], ...]:
        out = []
        for _ in range(rng.choice((0, 1, 1, 2))):
            start = rng.randrange(0, 4000, 8)
            out.append((start, start + rng.choice((8, 16, 64, 256))))
        return tuple(out)

    def overlap(a, b) -> bool:
        return any(s < e2 and s2 < e for s, e in a for s2, e2 in b)

    def fail(first: int) -> None:  # first ends abnormally; its dependants fail with it
        doomed, todo = [first], [first]
        while todo:
            gone = todo.pop()
            for o, (_, _, deps) in live.items():
                if gone in deps and o not in doomed:
                    doomed.append(o)
                    todo.append(o)
        for o in doomed:
            reads, writes, _ = live.pop(o)
            index.remove(o, reads, writes, False)

    for op in range(6000):
        if live and rng.random() < 0.03:
            fail(rng.choice(list(live)))
            continue
        if live and (len(live) > 300 or rng.random() < 0.45):
            ready = [o for o, (_, _, deps) in live.items() if not deps & live.keys()]
            done = rng.choice(ready)
            reads, writes, _ = live.pop(done)
            index.remove(done, reads, writes, True)
            continue
        reads, writes = ranges(), ranges()
        found = set(index.conflicts(reads, writes))
        must = {o for o, (r, w, _) in live.items()
                if overlap(writes, r) or overlap(writes, w) or overlap(reads, w)}
        assert found <= must
        reach, todo = set(found), list(found)
        while todo:
            for dep in live[todo.pop()][2]:
                if dep in live and dep not in reach:
                    reach.add(dep)
                    todo.append(dep)
        assert must <= reach, (op, must - reach)
        live[op] = (reads, writes, found)
        index.add(op, reads, writes)
    assert len(index._starts) >= len(index._regions)


class _Held:
    """Stands for a caller's buffer that a backend uses by address."""


class _Holds:
    """Such stand-ins by name, and which of them are still alive."""

    def __init__(self):
        self.refs = {}

    def __call__(self, name):
        obj = _Held()
        self.refs[name] = weakref.ref(obj)
        return obj

    def alive(self):
        return sorted(name for name, ref in self.refs.items() if ref() is not None)


def test_an_operation_holds_its_buffers_until_it_ends_however_it_ends(engine, mpi, gloo):
    """``hold`` stays alive while the operation is unfinished and is let go when it finishes,
    fails, is cancelled or fails with a dependency; ``start`` and ``args`` are let go once it
    is issued, or once it ends unissued (an operation in flight keeps two objects fewer for
    the garbage collector)."""
    held = _Holds()
    a = submit(engine, mpi, "allreduce", writes=[A], hold=held("a"))  # issued at once
    b = submit(engine, mpi, "allreduce", writes=[A], hold=held("b"))  # waits for a
    c = submit(engine, gloo, "allreduce", writes=[B], hold=held("c"))
    d = submit(engine, gloo, "allreduce", writes=[B], hold=held("d"))  # waits for c
    e = submit(engine, gloo, "allreduce", after=[b], hold=held("e"))  # fails with b
    assert (a._start, a._args) == (None, None) and b._args == ("allreduce",)
    assert held.alive() == ["a", "b", "c", "d", "e"]
    finish(engine, mpi, 0)
    assert a.state == "DONE" and b.state == "ISSUED" and b._args is None
    assert held.alive() == ["b", "c", "d", "e"]
    assert d.cancel()
    assert held.alive() == ["b", "c", "e"] and (d._start, d._args) == (None, None)
    finish(engine, mpi, 1, error=RuntimeError("link down"))
    assert b.state == "FAILED" and e.state == "FAILED" and (e._start, e._args) == (None, None)
    assert held.alive() == ["c"]
    finish(engine, gloo, 0)
    assert c.state == "DONE" and held.alive() == []

    # The lone wait settles in a written-out copy of the common case: it lets go too.
    lone = Engine(background=False)
    fut = submit(lone, _Counting(after=3), "allreduce", hold=held("lone"))
    assert held.alive() == ["lone"]
    fut.wait(timeout=5.0)
    assert held.alive() == []


class _Uncancellable(ManualBackend):
    """Like MPI's collectives: an issued request cannot be cancelled."""

    def cancel(self, request):
        return False


def test_an_issued_operation_that_fails_keeps_its_buffers_if_its_backend_may_still_use_them(
        clock, gloo):
    """A timed-out or aborted operation whose backend cannot cancel it may still have its
    memory read or written by that backend: its buffers (and its result) stay alive. One
    that its backend cancelled, or that was never issued, lets go."""
    mpi = _Uncancellable(name="mpi")
    engine = Engine(background=False, clock=clock, timeout=10.0)
    held = _Holds()
    a = submit(engine, mpi, "allreduce", writes=[A], hold=held("a"))
    b = submit(engine, gloo, "allreduce", hold=held("b"))  # its backend cancels it
    clock.now += 11
    engine.check_deadlines(clock.now)
    assert isinstance(a.exception(), CommTimeoutError)
    assert isinstance(b.exception(), CommTimeoutError)
    assert held.alive() == ["a"]
    c = submit(engine, mpi, "allreduce", writes=[B], hold=held("c"))
    d = submit(engine, mpi, "allreduce", writes=[B], hold=held("d"))  # waits for c
    assert engine.fail_all(lambda f: RuntimeFinalizedError("finalized")) == 2
    assert c.state == d.state == "FAILED"
    assert held.alive() == ["a", "c"]
