"""Drivers: who calls ``poll_once``, and how they idle between polls.

Three drivers share the engine:

- the thread that waits (``fut.wait()``) polls itself. Handing the wait to another thread was
  rejected: a ``call_soon_threadsafe`` round trip costs ~70 µs here, 30x a small MPI allreduce;
- a coroutine that awaits (``await fut``) polls from the running event loop, giving the loop
  back between polls with a bare ``yield`` (one loop iteration, no thread hop);
- a background thread polls only while nobody else does, so that communication advances
  while the caller computes; it parks whenever a waiter drives or nothing is in flight
  (where the ranks fill the node's cores, longer each time it finds nothing to poll).

Idling is adaptive, because on 2 cores spinning starves gloo's own threads (0.2 ms becomes
2 ms) and oversubscribed MPI ranks (4.5 ms per op instead of ~20 µs): spin a few polls only
when no self-progressing backend is in flight and the node is not oversubscribed, then
``os.sched_yield()`` between polls, then sleep for a small fraction of the time waited so far
(so a long wait overshoots by a few per cent at most) -- but never sleep while MPI work is in
flight: its data moves only inside polls, and sleeping doubled a 64 MiB allreduce.
``asyncio.sleep`` was rejected as back-off: its timer resolution made 4 ms steps.

Before any of that, a waiter on the only request in flight, of a backend that moves data
only while polled (MPI) spins on that request with direct tests (``Engine.spin_lone``): a
test costs ~0.2 µs where a poll of every track costs ~0.7, most of a small MPI operation's
wait (docs/performance.md has the figures). A lone gloo operation is instead waited for
blocking in gloo after ``block_seconds`` (at once from ``block_bytes``): by ``wait()`` until
it ends; by ``await`` in slices of at most 1 ms in the loop's own thread, then, after
``await_block_seconds``, through the background thread. ``benchmarks/overhead.py`` measures
the result.
"""

from __future__ import annotations

import _thread
import asyncio
import logging
import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core._errors import RuntimeFinalizedError
from ._states import DONE, ISSUED

if TYPE_CHECKING:
    from ._future import CommFuture
    from ._progress import Engine

__all__ = ["PollPolicy", "ProgressThread", "drive_async", "wait"]

_clock = time.perf_counter
_log = logging.getLogger("mcrdl")
_sched_yield = os.sched_yield
_sleep = time.sleep
#: Longest single block in a backend (seconds), so that deadlines are still checked.
_BLOCK_SLICE = 0.05
#: Longest single block of an awaiting event loop's thread in a backend (seconds): the loop's
#: other tasks wait at most this long at a time (gloo's timed wait counts whole milliseconds).
_AWAIT_SLICE = 1e-3


@dataclass(frozen=True)
class PollPolicy:
    """How drivers idle between polls that find nothing finished.

    Attributes:
        spin_polls: idle polls a waiter spins before yielding, when spinning is safe.
        lone_spins: direct tests a waiter spins on the only request in flight first, when
            spinning is safe and its backend moves data only while polled (MPI); a test costs
            ~0.2 µs where a poll costs ~0.7 (``Engine.spin_lone``).
        yield_seconds: how long a waiter yields the CPU between polls before it sleeps
            (an awaiting coroutine hands the wait to the background thread instead).
        block_seconds: how long a waiter yield-polls a lone operation whose backend can
            block (gloo) before it blocks in the backend instead (an ``await`` in slices of
            at most 1 ms, giving the loop an iteration between them).
        block_bytes: a lone operation on such a backend moving at least this many bytes is
            blocked on at once: its polls only take the CPU from gloo's threads (wait/raw
            per-pair medians, two runs: alltoall 4 MiB 0.94-1.01 against 1.10-1.11 polled
            first, broadcast 4 MiB 1.04-1.08 against 1.25-1.30; at 64 KiB polling first
            was the better, 0.88-1.06 against 0.95-1.13).
        await_block_seconds: how long an ``await`` waits for such an operation in its own
            thread before it hands it to the background thread, which blocks in the backend
            for it while the loop sleeps. Longer than ``block_seconds``: the hand-off costs
            ~110 µs, and at 0.3 ms both ranks of a back-to-back 256 KiB gloo alltoall fell
            into handing off every call (616 µs a call against 290 µs raw). Oversubscribed
            too: handing off at once made a 4-rank 4-byte await 1.2-1.4x raw gloo.
        sleep_fraction: a waiter's sleep lasts this fraction of the time waited so far...
        sleep_max: ...but never longer than this (seconds).
        background_min, background_max: the background thread's poll interval bounds; it
            doubles while nothing finishes and resets when something does.
        background_nap_max: the longest nap of the background thread while it finds
            nothing to poll (no work in flight, or a caller that drives or keeps submitting).
            Each such nap doubles the next, from ``background_max``; a poll, a wait handed
            over to it (``Engine.wake_background``) or a wake from its deep sleep resets it.
            None (the default), or anything up to ``background_max``: no doubling, the
            thread looks every ``background_max`` (``nap_max``). The runtime raises it to
            4 ms where the ranks fill the node's cores, one rank a core (not where they
            oversubscribe them: longer naps slowed steps there): there each wake takes a
            rank's core and its GIL (~40-70 µs of the caller's time, about one per
            millisecond of a busy caller), and polls during compute only move MPI's CPU
            work onto the compute's own core. The price: once a busy caller, or a stretch with nothing in flight,
            turns to compute with work in flight, the polls start up to ``nap_max`` later
            (a submission does not wake a napping thread; docs/performance.md has both
            sides).
        deep_idle: seconds without work after which the background thread sleeps until a
            submission wakes it (before that it naps, ``background_max`` up to ``nap_max``).
        oversubscribed: more ranks than cores on this node: never spin; and a waiter for an
            operation of a self-progressing backend (gloo) naps ``give_way_seconds`` where it
            would yield the CPU between polls (``give_way``).
        give_way_seconds: that nap.
    """

    spin_polls: int = 64
    lone_spins: int = 256
    yield_seconds: float = 5e-3
    block_seconds: float = 3e-4
    block_bytes: int = 1 << 20
    await_block_seconds: float = 2e-3
    sleep_fraction: float = 1 / 32
    sleep_max: float = 1e-3
    background_min: float = 20e-6
    background_max: float = 1e-3
    background_nap_max: float | None = None
    deep_idle: float = 0.1
    oversubscribed: bool = False
    give_way_seconds: float = 50e-6

    def give_way(self, fut: CommFuture) -> None:
        """Let other threads run before the next poll of a waiter for ``fut``.

        ``sched_yield``; but on an oversubscribed node, for an operation of a
        self-progressing backend (gloo), a ``give_way_seconds`` nap: with more runnable
        threads than cores, the yield loops of ranks waiting for such an operation (a named
        one, say, whose agreement rounds on MPI keep MPI work in flight) kept the other
        ranks' gloo threads, which must move its data, off the CPU: at 4 ranks on 2 cores,
        one in 8 named gloo alltoallvs took 65-320 ms instead of ~3. Napping for every
        operation was rejected: small MPI operations at 4 ranks took 2x as long
        (``benchmarks/versions.py``: 614-776 µs against 258-384).
        """
        if self.oversubscribed and fut.lane.track.self_progressing:
            _sleep(self.give_way_seconds)
        else:
            _sched_yield()

    @property
    def nap_max(self) -> float:
        """The background thread's longest nap: ``background_nap_max``, never below
        ``background_max``."""
        if self.background_nap_max is None:
            return self.background_max
        return max(self.background_nap_max, self.background_max)

    @property
    def patience(self) -> float:
        """Seconds a waiter yields between polls before it may sleep or block.

        With only self-progressing work (gloo) in flight, yielding polls find a short
        operation soonest; on an oversubscribed node they take the CPU its threads need
        (7.6 ms against 3.4 ms for a blocking wait, 4 ranks on 2 cores): no patience there.
        """
        return 0.0 if self.oversubscribed else self.yield_seconds

    @property
    def block_patience(self) -> float:
        """Seconds a ``wait()`` yield-polls a lone gloo operation before blocking in it.

        Short operations are found sooner by polls (190 µs against 230 µs for a small
        broadcast through a timed ``Work.wait``), but polling a long one the whole time takes
        the CPU from gloo's own threads: a 4 MiB broadcast took 3.9 ms yield-polled for up to
        5 ms against 1.4 ms blocking after 0.3 ms (raw torch.distributed: 1.8 ms).
        """
        return min(self.block_seconds, self.patience)

    def block_after(self, nbytes: int) -> float:
        """Seconds a waiter polls a lone gloo operation of ``nbytes`` before blocking in it."""
        return 0.0 if nbytes >= self.block_bytes else self.block_patience

    def nap(self, waited: float) -> float:
        """How long a waiter that has waited ``waited`` seconds sleeps before its next poll."""
        return min(self.sleep_max, max(waited, 1e-4) * self.sleep_fraction)


def wait(engine: Engine, fut: CommFuture, timeout: float | None, until: int = DONE) -> None:
    """Poll from the calling thread until ``fut`` is done (or, with ``until=ISSUED``, issued)
    or ``timeout`` seconds passed."""
    poll = engine.poll_once
    # After a poll that moved something, the operation may be issued (a named one once its
    # members agreed, one that waited behind others in its lane): spin on it alone, as
    # CommFuture.wait and __await__ do first (Engine.spin_lone), here and below. Polled with
    # a loop iteration between polls, an MPI message moves only at each poll: named 64 KiB
    # allreduces awaited from 8 tasks took 1.23-1.56x unnamed ones that way, 1.24-1.39x spun
    # on (docs/performance.md).
    if poll() and until == DONE:
        engine.spin_lone(fut)
    if fut._state >= until:
        engine.last_active = engine._clock()
        return
    if engine._closed:
        raise RuntimeFinalizedError(
            f"cannot wait on {fut!r}: the runtime was finalized ({engine._closed_why})"
        )
    policy = engine.policy
    engine.drivers += 1
    engine.waiting.append(fut)
    try:
        t0 = _clock()
        deadline = None if timeout is None else t0 + timeout
        spin = policy.spin_polls if engine.spin_ok() else 0
        patience = policy.patience
        block_at = policy.block_after(fut.nbytes)
        idle = 0
        while fut._state < until:
            if poll():
                if until == DONE and engine.spin_lone(fut):
                    return
                idle = 0
                spin = policy.spin_polls if engine.spin_ok() else 0
                continue
            idle += 1
            if idle <= spin:
                continue
            if engine.idle_hook is not None:
                engine.check_deadlines(engine._clock())
                if fut._state < until:
                    engine.idle_hook()
                continue
            now = _clock()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{fut!r} did not finish within {timeout} s; it is still in flight"
                )
            engine.check_deadlines(engine._clock())
            waited = now - t0
            if engine.needs_polls():
                policy.give_way(fut)
            elif waited >= block_at and _may_block(engine, fut):
                _block(engine, fut, deadline)
            elif waited < patience:
                policy.give_way(fut)
            else:
                _sleep(policy.nap(waited))
    finally:
        # The background thread is not woken here: it naps (background_max, up to
        # nap_max) and finds the work itself. Waking it on every exit made a waiter of N
        # futures pay N GIL hand-offs (32 µs per operation instead of 12 with 10 in flight).
        engine.drivers -= 1
        engine.waiting.remove(fut)
        engine.last_active = engine._clock()


def _block(engine: Engine, fut: CommFuture, deadline: float | None) -> None:
    """Block in the backend while ``fut`` is the only unfinished operation, if it can.

    For long waits only: polling a lone gloo collective competes with gloo's own threads for
    the CPU (16 MiB took 22 ms polled against 17 ms blocked here), but a short one is found
    sooner by yielding polls than by a timed ``Work.wait`` (190 µs against 230 µs for a small
    broadcast). With nothing else in flight, nobody needs the engine to poll meanwhile.
    Slices keep the deadline checks going.
    """
    while _may_block(engine, fut):
        now = _clock()
        if deadline is not None and now >= deadline:
            return
        engine.check_deadlines(engine._clock())
        _block_slice(engine, fut, _BLOCK_SLICE if deadline is None
                     else min(_BLOCK_SLICE, deadline - now))


def _may_block(engine: Engine, fut: CommFuture) -> bool:
    """Whether a waiter may block in ``fut``'s backend: ``fut`` is issued and the only
    unfinished operation (nobody else needs the engine to poll), and the backend can block."""
    return fut._state == ISSUED and engine._unfinished == 1 and fut.lane.blocking


def _block_slice(engine: Engine, fut: CommFuture, seconds: float) -> None:
    """Block in ``fut``'s backend for it up to ``seconds``, then poll (which settles it)."""
    # Read without the lock: a thread issuing fut just now sets its state before its request.
    request = getattr(fut, "_request", None)
    if request is not None:
        fut.lane.backend.block(request, seconds)
    engine.poll_once()


def _set_none(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def drive_async(engine: Engine, fut: CommFuture) -> Generator[Any, None, None]:
    """Poll from the running event loop until ``fut`` is done.

    Called by ``CommFuture.__await__`` once its lone spin (``Engine.spin_lone``, up to
    ``lone_spins`` direct tests, ~50 µs) has not finished ``fut``. Short waits never leave
    the loop's thread: a few polls in place (when spinning is safe: a
    small operation finishes within them, and a loop iteration costs more than the whole
    operation), then each idle poll gives the loop one iteration (a bare ``yield``).
    A wait longer than ``yield_seconds`` is handed to the background thread, which resolves
    an asyncio future through ``call_soon_threadsafe``: by then the ~70 µs hand-off is noise,
    and the loop can sleep instead of spinning. A lone operation on a backend that can block
    (gloo) is waited for blocking in it from ``block_seconds`` on (at once from
    ``block_bytes``), as ``wait()`` does, since yield-polling it takes the CPU from gloo's own
    threads: one slice of at most 1 ms at a time, with one loop iteration between slices, and
    after ``await_block_seconds`` through the background thread. Against raw gloo, per-pair medians of 12 points (16 KiB-4 MiB,
    allreduce, broadcast, alltoall) read 0.84-1.23 this way against 0.92-1.25 polling until
    the hand-off.
    """
    if fut._route is not None and type(fut._route) is not tuple:
        # A named operation not yet agreed on: one loop iteration first, in which sibling
        # tasks submit theirs, so that one agreement round takes them all (Names.ready);
        # then its lone spin (the awaiting CommFuture.__await__ spun before calling here,
        # when the operation could not spin yet).
        yield
        if fut._state >= DONE or engine.spin_lone(fut):  # (a sibling's polls, or the spin)
            return
    poll = engine.poll_once
    policy = engine.policy
    patience = policy.patience
    block_at = policy.block_after(fut.nbytes)
    hand_at = policy.await_block_seconds
    lone = False
    engine.drivers += 1
    engine.waiting.append(fut)
    try:
        if engine.spin_ok():
            for _ in range(policy.spin_polls):
                if poll() and engine.spin_lone(fut):  # (as in wait)
                    return
                if fut._state >= DONE:  # (by this poll, or by the background thread's)
                    return
        t0 = _clock()
        mark = engine._n_polls  # the poll count after this coroutine's last poll (its own)
        while fut._state < DONE:
            if engine._n_polls != mark:
                # Polled by somebody else since this coroutine's last turn: another awaiting
                # task of the loop drives (or a thread does). One poll per loop iteration is
                # enough; each more costs its task a poll and a sched_yield for nothing.
                # (Parking such tasks on asyncio futures until the driver leaves was tried:
                # no better, 1.70-1.79x against 1.74-1.75x for named 4 B tasks.)
                mark = engine._n_polls
                yield
                continue
            progressed = poll()
            mark = engine._n_polls
            if progressed:
                if engine.spin_lone(fut):
                    return
                continue
            now = _clock()
            engine.check_deadlines(engine._clock())
            waited = now - t0
            if waited >= block_at and _may_block(engine, fut):
                if waited >= hand_at and engine.has_background:
                    lone = True  # the background thread blocks in the backend for it
                    break
                # Block in the backend here, one short slice at a time, with one loop
                # iteration for the other tasks between slices.
                _block_slice(engine, fut, _AWAIT_SLICE)
                if fut._state < DONE:
                    yield
                continue
            if waited >= patience and not engine.needs_polls():
                if engine.has_background:
                    break
                # Nobody to hand the wait to: sleep in the loop instead of spinning it.
                yield from asyncio.sleep(policy.nap(waited)).__await__()
                continue
            policy.give_way(fut)
            yield  # one event-loop iteration for the other tasks
    finally:
        engine.drivers -= 1
        engine.waiting.remove(fut)
    if fut._state >= DONE:
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    fut.add_done_callback(lambda _: loop.call_soon_threadsafe(_set_none, waiter))
    engine.wake_background(fut if lone else None)
    engine.waiting.append(fut)
    try:
        yield from waiter
    finally:
        engine.waiting.remove(fut)


class ProgressThread:
    """Polls the engine while work is in flight and no waiter drives it.

    Waking a thread costs its waker a GIL hand-off later, so submissions do not wake it: a
    recently active thread naps (``background_max``, doubling up to ``nap_max`` while it
    finds nothing to poll) and finds new work by itself; only after ``deep_idle`` seconds
    without work does it sleep until a submission wakes it (``deep``). An awaiting coroutine
    that hands its wait over wakes it at once (``wanted``).

    Invariants:
    - ``parked`` is True only while the thread is blocked (or about to block) on ``_wake``;
      ``deep`` only while it blocks without a timeout.
    - the thread is started on the first ``wake()`` and is a daemon: a process that never
      finalizes still exits.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._wake = _thread.allocate_lock()
        self._wake.acquire()
        self._stop = False
        self._thread: threading.Thread | None = None
        #: True while the thread waits to be woken (set before it blocks).
        self.parked = True
        #: True while it waits without a timeout: only a wake() brings it back.
        self.deep = True
        #: A lone operation an awaiting coroutine handed over: block in its backend for it.
        self.lone: CommFuture | None = None
        #: Set by ``wake()``, and by a wait handed over (``Engine.wake_background``) before it
        #: reads ``parked``: a park that starts meanwhile returns at once, and the next turn
        #: resets the nap (only the thread itself writes ``_nap``).
        self.wanted = False
        self._interval = 0.0
        #: How long its next park for lack of anything to poll lasts (``_doze``).
        self._nap = engine.policy.background_max
        self._idle_since = 0.0

    def wake(self) -> None:
        """Unpark the thread (start it the first time)."""
        if self._thread is None:
            if self._stop:
                return
            self._thread = threading.Thread(target=self._run, name="mcrdl-progress", daemon=True)
            self._thread.start()
        self.parked = self.deep = False
        self.wanted = True  # (its next turn naps short: it resets its own nap)
        try:
            self._wake.release()
        except RuntimeError:  # released already and not yet taken: it will not block
            pass

    def stop(self) -> None:
        """Stop and join the thread."""
        self._stop = True
        thread = self._thread
        if thread is not None:
            self.wake()
            thread.join(timeout=5.0)

    def _park(self, timeout: float, *, for_work: bool = False) -> None:
        """Block until woken or ``timeout`` (< 0: no timeout).

        ``for_work``: parked because nothing was in flight; then re-check after publishing
        ``parked``, so that work submitted just before is not missed. (A back-off park must
        not re-check: with work in flight it would return at once, and the thread would spin,
        fighting the caller for the GIL: 35 µs per operation instead of 8.)
        """
        engine = self._engine
        self.parked = True
        self.deep = timeout < 0
        if self._stop or self.wanted or (for_work and engine._unfinished):
            self.parked = self.deep = False
            return
        self._wake.acquire(True, timeout)
        self.parked = self.deep = False

    def _doze(self, policy: PollPolicy, *, for_work: bool = False) -> None:
        """Park for lack of anything to poll, for the current nap; the next lasts twice as
        long, up to ``nap_max`` (a thread that keeps finding nothing to do wakes, and takes
        the GIL from the caller, less often)."""
        self._park(self._nap, for_work=for_work)
        self._nap = min(2 * self._nap, policy.nap_max)

    def _run(self) -> None:
        engine = self._engine
        policy = engine.policy
        self._interval = policy.background_min
        self._idle_since = _clock()
        while not self._stop:
            try:
                self._step(engine, policy)
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                _log.error("mcrdl's progress thread caught an unexpected error and goes on",
                           exc_info=True)
                _sleep(policy.background_max)

    def _step(self, engine: Engine, policy: PollPolicy) -> None:
        """One turn of the thread: block for a handed-over lone operation, park while there
        is nothing to do or somebody else drives, else poll once, check deadlines, nap."""
        if self.wanted:  # woken, or a wait handed over: look again soon, whatever it finds
            self.wanted = False
            self._nap = policy.background_max
        lone = self.lone
        if lone is not None:
            self.lone = None
            if not engine.drivers:
                _block(engine, lone, None)
            return
        if not engine._unfinished:
            if _clock() - self._idle_since > policy.deep_idle:
                self._park(-1, for_work=True)  # (the wake() that ends it marks it wanted)
                self._idle_since = _clock()
            else:
                self._doze(policy, for_work=True)
            self._interval = policy.background_min
            return
        self._idle_since = _clock()
        if engine.drivers or engine._clock() - engine.last_active < policy.background_max:
            # A waiter drives, or the caller is busy submitting and waiting: polling now
            # would only fight it for the GIL and the lock (10,000 operations in flight
            # cost 15 µs each instead of 8 with the thread polling between the waits).
            self._doze(policy)
            return
        self._nap = policy.background_max
        if engine.poll_once() or engine.needs_polls():
            self._interval = policy.background_min
        else:
            self._interval = min(self._interval * 2, policy.background_max)
        # Whatever is in flight: a timeout or an abort must surface while the caller
        # computes, not only when some thread waits (it is rate-limited inside).
        engine.check_deadlines(engine._clock())
        _sleep(self._interval)
