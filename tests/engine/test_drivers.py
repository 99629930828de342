"""The drivers (``engine._drivers``): who polls, and how a waiter idles, spins, blocks or hands
its wait over; the background thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mcrdl import BackendError, CommTimeoutError
from mcrdl.engine import Engine
from tests.engine.support import A, Blocking, Counting, awaited, submit
from tests.manual_backend import ManualBackend


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

def test_a_lone_wait_on_a_blocking_backend_blocks_after_block_seconds():
    """block_seconds, not yield_seconds, decides when a lone gloo-like wait blocks: with
    yield_seconds at 60 s the wait would otherwise yield-poll past its 5 s timeout."""
    from mcrdl.engine import PollPolicy

    backend = Blocking()
    engine = Engine(background=False, policy=PollPolicy(yield_seconds=60.0, block_seconds=0.0))
    fut = submit(engine, backend, "allreduce")
    fut.wait(timeout=5.0)
    assert fut.done() and len(backend.blocked) == 1

def test_a_large_lone_wait_on_a_blocking_backend_blocks_at_once():
    """An operation of block_bytes or more is blocked on without polling first: with
    block_seconds and yield_seconds at 60 s, a smaller one would poll past its timeout."""
    from mcrdl.engine import PollPolicy

    backend = Blocking()
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

    backend = Blocking()
    engine = Engine(policy=PollPolicy(yield_seconds=60.0, await_block_seconds=0.0))
    try:
        fut = submit(engine, backend, "allreduce")

        async def main():
            return await asyncio.wait_for(awaited(fut), 5.0)

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
    backend = Blocking(finish_on=3, probe=lambda: ticks[0])
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
            await asyncio.wait_for(awaited(fut), 5.0)
            await task

        asyncio.run(main())
        assert fut.done() and len(backend.blocked) == 3
        assert all(thread is threading.main_thread() for thread, _, _ in backend.blocked)
        assert all(timeout <= 1e-3 for _, timeout, _ in backend.blocked)
        first, second, third = (tick for _, _, tick in backend.blocked)
        assert first < second < third  # the other task ran between slices
    finally:
        engine.close("test over")

def test_a_lone_wait_spins_on_its_request_and_settles_it():
    """The only unfinished operation, on a backend that moves data only while polled, is
    waited for by direct tests (Engine.poll in focus), not by polls of every track; a failure
    there fails the future with the backend's error; an oversubscribed node never spins."""
    from mcrdl.engine import PollPolicy

    backend = Counting(after=5)
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
    assert fut.args is None and fut.hold is None  # buffers released at once

    # A simulated world's ranks progress only in its scheduler: its policy has no lone
    # spins, and a poll in focus walks the tracks there.
    hooked = Counting(after=3)
    engine = Engine(background=False, policy=PollPolicy(spin_polls=0, burst=0))
    fut = submit(engine, hooked, "allreduce")
    assert engine.poll(fut) is False and hooked.one_tests == 0 and hooked.tests == 1
    engine = Engine(background=False)
    fut = submit(engine, hooked, "allreduce")
    assert engine.poll(fut) is True and hooked.one_tests == 3 and hooked.tests == 1

    failing = Counting(after=2, error=BackendError("link down"))
    engine = Engine(background=False)
    fut = submit(engine, failing, "allreduce")
    with pytest.raises(BackendError, match="link down"):
        fut.wait(timeout=5.0)
    assert fut.state == "FAILED" and engine.in_flight() == 0

    slow = Counting(after=10**9)
    engine = Engine(background=False, policy=PollPolicy(oversubscribed=True))
    fut = submit(engine, slow, "allreduce")
    with pytest.raises(TimeoutError):
        fut.wait(timeout=0.05)
    assert slow.one_tests == 0 and slow.tests > 0

def test_a_lone_spin_counts_as_a_driver_so_the_background_thread_keeps_off():
    """Once a waiter's first poll has not finished its lone operation, the engine counts it
    as a driver while it spins, so the background thread parks instead of polling beside it:
    a test of a large MPI message moves a chunk of it, the spin can last the whole operation,
    and the thread's polls beside it slowed large operations (docs/performance-log.md)."""
    burst = Engine(background=False).policy.burst
    backend = Counting(after=burst + 5)
    engine = Engine(background=False)
    fut = submit(engine, backend, "allreduce")
    seen = []
    real_test_one = backend.test_one

    def test_one(request):
        seen.append(engine.drivers)
        return real_test_one(request)

    backend.test_one = test_one  # type: ignore[method-assign]
    fut.wait(timeout=5.0)
    assert seen == [0] * burst + [1] * 5 and engine.drivers == 0


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

def test_an_awaited_lone_spin_is_bounded_before_the_loop_gets_a_turn():
    """``await`` spins at most ``spin_polls`` polls after its first before it gives the
    event loop an iteration, as ``wait()`` spins at most that many before it yields; on a
    lone request each is a burst of direct tests."""
    backend = Counting(after=10**9)
    engine = Engine(background=False)
    fut = submit(engine, backend, "allreduce")
    seen = []

    async def main():
        async def other():  # runs at the awaiting task's first yield
            seen.append(backend.one_tests)
            backend.after = 0  # (its request has finished)

        task = asyncio.ensure_future(other())
        await fut
        await task

    asyncio.run(main())
    assert fut.done()
    policy = engine.policy  # (its first poll, spin_polls spun, the last that found it idle)
    assert seen[0] == policy.burst * (2 + policy.spin_polls)

def test_a_lone_spin_stops_when_another_operation_arrives():
    """Direct tests of a lone request come in bursts under one hold of the lock, so an
    operation that another thread submits meanwhile gets in between, and is polled by the
    very next poll: no direct test follows its arrival (rule 5 of docs/design.md); and a wait
    that starts with two in flight never spins."""
    backend = Counting(after=10**9)
    engine = Engine(background=False)
    first = submit(engine, backend, "allreduce")
    go = threading.Event()
    real_test_one = backend.test_one

    def test_one(request):
        if backend.one_tests == 3:
            go.set()
        return real_test_one(request)

    backend.test_one = test_one  # type: ignore[method-assign]

    at_arrival = []

    def arrive():  # another thread submits while the first waiter spins
        go.wait(5.0)
        submit(engine, backend, "allreduce", comm="other")
        at_arrival.append(backend.one_tests)
        for req in backend.started:
            req.done = True

    thread = threading.Thread(target=arrive)
    thread.start()
    assert first.wait(timeout=5.0) is None
    thread.join(5.0)
    assert backend.tests > 0  # the general poll found both
    assert at_arrival == [backend.one_tests]
    engine.poll()
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


def test_a_wait_with_a_request_of_another_backend_in_flight_polls_both():
    """Rule 5: a request of another backend in flight makes a wait no lone spin: each poll
    tests every backend, so that one moves too. Here the waited operation ends only once the
    other backend's request has been polled, as an MPI operation may need its peer's work on
    another backend to move first."""
    other = Counting(after=10**9, name="gloo")  # (a backend that moves only while tested)

    class Needs(ManualBackend):
        def test(self, requests):
            if other.tests:
                for request in requests:
                    request.done = True
            return super().test(requests)

    mine = Needs(name="mpi")
    engine = Engine(background=False)
    submit(engine, other, "allreduce", comm="b")
    fut = submit(engine, mine, "allreduce", comm="a")
    assert fut.wait(timeout=5.0) is None and other.tests > 0


def test_a_wait_spins_on_the_only_request_in_flight_with_a_queue_behind_it():
    """A burst on a lane that issues one collective at a time (MPI's window): the request in
    flight is the only one, the rest wait for it, so each wait spins on it with direct tests
    as on a lone operation (before, the waits of a burst of 64 polled every track: its drain
    took twice as long per operation at 64 KiB); its settle issues the next."""
    from dataclasses import replace

    backend = Counting(after=3)  # the first finishes on the third test, the rest on their first
    backend.capabilities = replace(backend.capabilities, issue_window=1)
    engine = Engine(background=False)
    futs = [submit(engine, backend, "allreduce", writes=[(0x1000 * (i + 1), 0x1000 * (i + 1) + 8)])
            for i in range(4)]
    assert len(backend.started) == 1  # one issued, three queued behind it
    for f in futs:
        f.wait(timeout=5.0)
    assert backend.one_tests == 3 + 1 + 1 + 1 and backend.tests == 0
    assert engine.in_flight() == 0


@pytest.mark.parametrize("spin_polls", [64, 0])  # (its first polls in place, or none)
def test_an_await_spins_on_its_operation_once_a_poll_issues_it(spin_polls):
    """An awaited operation that one of the awaiting task's polls issues (it waited behind
    another in its lane, as on MPI's window of one; a named one waits for its agreement) is
    then spun on alone (Engine.poll in focus, a burst of direct tests): polled with a loop
    iteration between polls, a large MPI message moves only at each poll."""
    from dataclasses import replace

    from mcrdl.engine import PollPolicy

    backend = Counting(after=4)
    backend.capabilities = replace(backend.capabilities, issue_window=1)
    engine = Engine(background=False, policy=PollPolicy(spin_polls=spin_polls))
    submit(engine, backend, "allreduce", writes=[(0x1000, 0x1008)])
    second = submit(engine, backend, "allreduce", writes=[(0x2000, 0x2008)])
    assert len(backend.started) == 1
    backend.started[0].done = True  # the next poll settles it and issues the second
    rescued = []

    async def main():
        async def rescue():  # runs only if the awaiting task yields to the loop
            while not second.done():
                if len(backend.started) > 1:
                    backend.started[1].done = True
                    rescued.append(True)
                await asyncio.sleep(0)

        task = asyncio.ensure_future(rescue())
        try:
            await asyncio.wait_for(awaited(second), 5.0)
        finally:
            task.cancel()

    asyncio.run(main())
    assert second.done() and not rescued
    assert backend.one_tests == 4  # by the spin's direct tests


class _FirstEndsAtPoll(Counting):
    """Counting, whose first request finishes at the ``poll``-th general test."""

    def __init__(self, poll: int):
        super().__init__(after=4)  # the others only by direct tests (the spin's)
        self.poll = poll

    def test(self, requests):
        if self.tests + 1 == self.poll:
            self.started[0].done = True
        return super().test(requests)


@pytest.mark.parametrize("poll", [1, 3])  # the waiter's first poll, or one in its loop
@pytest.mark.parametrize("spin_polls", [64, 0])  # (its first polls spun, or none)
def test_a_wait_spins_on_its_operation_once_a_poll_issues_it(spin_polls, poll):
    """``wait()`` as ``await``: an operation that one of the waiter's polls issues (behind
    another in MPI's window of one; a named one once its members agreed) is then spun on
    alone with direct tests (Engine.poll in focus), where a poll walks every track."""
    from dataclasses import replace

    from mcrdl.engine import PollPolicy

    backend = _FirstEndsAtPoll(poll)
    backend.capabilities = replace(backend.capabilities, issue_window=1)
    engine = Engine(background=False, policy=PollPolicy(spin_polls=spin_polls))
    submit(engine, backend, "allreduce", writes=[(0x1000, 0x1008)])
    second = submit(engine, backend, "allreduce", writes=[(0x2000, 0x2008)])
    assert len(backend.started) == 1
    assert second.wait(timeout=2.0) is None
    assert backend.tests == poll and backend.one_tests == 4
    assert engine.in_flight() == 0


def _until(predicate, seconds=5.0):
    import time

    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(1e-3)
    return True


def test_the_background_thread_checks_deadlines_while_mpi_work_is_in_flight(clock, mpi):
    """Nobody waits, and an MPI-like operation (its data moves only while polled, so the
    thread keeps polling it) outlives the timeout: the thread fails it by itself."""
    engine = Engine(clock=clock, timeout=5.0)
    try:
        stuck = submit(engine, mpi, "allreduce")
        engine.wake_background()
        clock.now += 6
        assert _until(stuck.done), "the timeout surfaced only when somebody waited"
        assert isinstance(stuck.exception(), CommTimeoutError)
    finally:
        engine.close("test over")


def _naps(policy, clock, mpi):
    """The background thread's parks, turn by turn (its ``_step`` called here, without the
    thread): while a waiter drives, once the caller is quiet with work in flight (a poll),
    while it drives again, with nothing in flight, after a ``wake()``, after a wake during a
    park, and after a wait handed over (``Engine.wake_background``), with and without a lone
    operation."""
    from mcrdl.engine import PollPolicy
    from mcrdl.engine._drivers import ProgressThread

    engine = Engine(background=False, clock=clock, policy=policy or PollPolicy())
    thread = ProgressThread(engine)
    parks: list[float] = []
    woken = []  # wake() during the next park (a wait handed over meanwhile)

    def park(timeout, *, for_work=False):
        parks.append(timeout)
        if woken:
            woken.pop()
            thread.wake()

    thread._park = park  # type: ignore[method-assign]
    thread._thread = threading.current_thread()  # (so that wake() starts no thread)
    thread.parked = thread.deep = False  # (the stub park never parks)
    engine._thread = thread  # (for wake_background)
    turns = []

    def turns_of(n):
        parks.clear()
        for _ in range(n):
            thread._step(engine)
        turns.append(list(parks))

    fut = submit(engine, mpi, "allreduce")
    engine.drivers = 1
    turns_of(4)
    engine.drivers = 0
    clock.now += 1.0  # the caller's last activity is long past: the thread polls
    turns_of(1)
    engine.drivers = 1
    turns_of(2)
    engine.drivers = 0
    mpi.finish(mpi.started[-1])
    engine.poll()
    assert fut.done()
    thread._idle_since = float("inf")  # (not idle long enough to sleep deep)
    turns_of(3)
    thread.wake()  # a submission, or a wait handed over: wanted now
    turns_of(1)
    turns_of(2)
    woken.append(True)
    turns_of(2)  # woken during the first park: the second is short again
    turns_of(2)
    engine.wake_background()  # handed over while the thread was not parked
    turns_of(1)
    turns_of(2)
    engine.wake_background(fut)  # a lone one (finished already: nothing to block in)
    turns_of(2)
    return turns


def test_the_background_thread_naps_longer_while_it_finds_nothing_to_poll(clock, mpi):
    """With ``background_nap_max`` above ``background_max`` (the runtime's choice where the
    ranks fill the cores), each turn that finds nothing to poll doubles the next nap up to
    the maximum; a poll or a wake resets it. By default it naps ``background_max`` every
    turn."""
    from mcrdl.engine import PollPolicy

    ms = 1e-3
    assert _naps(PollPolicy(background_nap_max=4 * ms), clock, mpi) == [
        [ms, 2 * ms, 4 * ms, 4 * ms],  # a waiter drives
        [],  # quiet caller, work in flight: it polls (and naps background_min, unparked)
        [ms, 2 * ms],  # driven again: from background_max
        [4 * ms, 4 * ms, 4 * ms],  # nothing in flight: it keeps doubling (capped)
        [ms],  # woken: from background_max again
        [2 * ms, 4 * ms],
        [4 * ms, ms],  # woken while parked
        [2 * ms, 4 * ms],
        [ms],  # a wait handed over
        [2 * ms, 4 * ms],
        [ms],  # a lone operation handed over (its turn blocks in it, then a short nap)
    ]
    assert _naps(None, clock, mpi) == [[ms] * 4, [], [ms] * 2, [ms] * 3, [ms], [ms] * 2,
                                       [ms] * 2, [ms] * 2, [ms], [ms] * 2, [ms]]
    # A longer background_max and no background_nap_max: never shorter than background_max.
    assert PollPolicy(background_max=2 * ms).nap_max == 2 * ms
    assert PollPolicy(background_max=2 * ms, background_nap_max=ms).nap_max == 2 * ms
    assert PollPolicy(background_nap_max=4 * ms).nap_max == 4 * ms


def test_a_wait_handed_over_as_the_thread_heads_for_a_nap_cuts_the_nap_short():
    """An awaiting coroutine hands its wait over (``Engine.wake_background``) after the
    thread decided to nap but before it parked: the park must not last the nap."""
    import time

    from mcrdl.engine._drivers import ProgressThread

    engine = Engine(background=False)
    thread = ProgressThread(engine)
    engine._thread = thread
    thread.parked = thread.deep = False  # (deciding, not parked yet)
    engine.wake_background()
    t0 = time.monotonic()
    thread._park(5.0)
    assert time.monotonic() - t0 < 1.0


def test_the_runtime_lets_the_thread_nap_longer_where_the_ranks_fill_the_cores_exactly():
    import os
    from types import SimpleNamespace

    from mcrdl.engine import PollPolicy
    from mcrdl.front._runtime import _poll_policy

    def _background_nap_max(bootstrap):
        return _poll_policy(bootstrap).background_nap_max

    cores = os.cpu_count() or 1
    assert _background_nap_max(SimpleNamespace(local_size=cores)) == 4e-3
    assert _background_nap_max(SimpleNamespace(local_size=cores + 2)) is None  # oversubscribed
    if cores > 1:
        assert _background_nap_max(SimpleNamespace(local_size=cores - 1)) is None
    assert _background_nap_max(None) is None
    assert PollPolicy().nap_max == PollPolicy.background_max  # (None: no doubling)
    # The same count says where waiters must never spin.
    assert _poll_policy(SimpleNamespace(local_size=cores + 1)).oversubscribed
    assert not _poll_policy(SimpleNamespace(local_size=cores)).oversubscribed


def test_the_background_thread_outlives_a_failure_and_a_raising_callback(mpi, caplog):
    """A callback that raises, or a backend failing in an unexpected way, must not end the
    thread: an await handed over to it would never resolve."""
    engine = Engine()
    try:
        first = submit(engine, mpi, "barrier")
        first.add_done_callback(lambda fut: 1 / 0)
        real_test = mpi.test
        calls = [0]

        def test(requests):  # one unexpected failure inside the poll
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("a backend bug")
            return real_test(requests)

        mpi.test = test  # type: ignore[method-assign]
        with caplog.at_level("ERROR", logger="mcrdl"):
            engine.wake_background()
            mpi.finish(mpi.started[0])
            assert _until(first.done)
            second = submit(engine, mpi, "barrier")
            engine.wake_background()
            mpi.finish(mpi.started[1])
            assert _until(second.done), "the thread died"
        messages = [r.getMessage() for r in caplog.records]
        assert any("progress thread caught an unexpected error" in m for m in messages)
        assert any("Exception in done-callback" in m for m in messages)
    finally:
        engine.close("test over")

@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_waiter_for_gloo_naps_between_polls_on_an_oversubscribed_node(oversubscribed,
                                                                       monkeypatch):
    """With MPI work in flight a waiter never sleeps long, but between polls it lets other
    threads run: sched_yield; except, on an oversubscribed node, a waiter for an operation
    of a self-progressing backend (gloo), which naps give_way_seconds: the yield loops kept
    other ranks' gloo threads off the CPU (named gloo alltoallvs stalled 65-320 ms at 4 ranks
    on 2 cores). A waiter for MPI still yields there (napping doubled small MPI operations)."""
    from mcrdl.engine import PollPolicy, _drivers

    yields, naps = [], []
    monkeypatch.setattr(_drivers, "_sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(_drivers, "_sleep", naps.append)
    mpi = Counting(after=10**9, name="mpi")
    gloo = ManualBackend(name="gloo", self_progressing=True)
    policy = PollPolicy(oversubscribed=oversubscribed, spin_polls=0, burst=0,
                        block_bytes=1 << 62, block_seconds=1e9, await_block_seconds=1e9)
    engine = Engine(background=False, policy=policy)
    on_mpi = submit(engine, mpi, "allreduce", comm="a")  # keeps MPI work in flight
    on_gloo = submit(engine, gloo, "allreduce", comm="b")

    async def awaiting(fut):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(fut, timeout=0.05)

    for fut, naps_expected in ((on_gloo, oversubscribed), (on_mpi, False)):
        for wait in (lambda: fut.wait(timeout=0.05), lambda: asyncio.run(awaiting(fut))):
            yields.clear()
            naps.clear()
            try:
                wait()
            except TimeoutError:
                pass
            if naps_expected:
                assert not yields and naps and set(naps) == {policy.give_way_seconds}
            else:
                assert yields and not naps
    for backend in (mpi, gloo):
        backend.finish(backend.started[0])
    assert on_mpi.wait(timeout=5.0) is None and on_gloo.wait(timeout=5.0) is None
