"""Idling: what a driver does between polls that moved nothing, decided in one place.

As asyncio's ``_run_once`` computes one timeout and trio's run loop yields its next deadline
to whichever driver runs it, the engine decides here what every driver does next, and checks
deadlines here; the drivers (`_drivers`: the thread that waits, the task that awaits, the
background thread) and the simulated world only carry the decision out.

The decision is adaptive, because on a node with a core per rank, spinning starves gloo's own
threads and oversubscribed MPI ranks: spin a few polls while no self-progressing backend is in
flight and the node is not oversubscribed (on an operation alone in flight, of a backend that
moves data only while tested, a poll is a burst of direct tests of its request: `Engine.poll`);
then let other threads run between polls; then sleep for a small fraction of the time waited
so far, so that a long wait overshoots by a few per cent at most -- but never sleep while MPI
work is in flight: its data moves only inside polls. A lone operation of a backend that can
block in a request (gloo) is waited for blocking in it instead, since polling it takes the CPU
from gloo's threads; an awaiting task blocks in short slices, then hands the wait to the
background thread, so that the event loop sleeps. ``asyncio.sleep`` was rejected as back-off
between polls: its timer resolution made steps of milliseconds. docs/performance.md has the
measurements behind each setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core._errors import CommTimeoutError, DesyncError
from ._lanes import ANY_PEER
from ._tracks import with_carried
from ._states import DONE

if TYPE_CHECKING:
    import threading

    from ._drivers import ProgressThread
    from ._future import CommFuture
    from ._lanes import CommState
    from ._names import Names
    from ._tracks import Track

__all__ = ["AWAIT", "BLOCK", "GIVE_WAY", "HAND_OFF", "Idling", "PARK", "POLL",
           "PollPolicy", "SCHEDULE", "SLEEP", "SPIN", "WAIT", "WAIT_WORK"]

# What a driver does before its next poll (the first of ``idle``'s answer; the second is
# seconds): poll again at once; let other threads run (seconds 0: ``sched_yield``, else a nap
# that long), and, awaiting, give the event loop one iteration; sleep that long (awaiting:
# ``asyncio.sleep``); block in the lone operation's backend up to that long; hand the wait to
# the background thread (awaiting only; seconds 1: it blocks in the lone operation); let the
# simulated world's scheduler run the other ranks.
SPIN, GIVE_WAY, SLEEP, BLOCK, HAND_OFF, SCHEDULE = range(6)
# What the background thread does next: park for lack of work (seconds -1: until woken),
# park while another drives or the caller is busy, poll.
WAIT_WORK, PARK, POLL = range(6, 9)

#: Who waits: a thread in ``wait()``, a task in ``await``.
WAIT, AWAIT = range(2)

#: Longest single block in a backend (seconds), so that deadlines are still checked.
_BLOCK_SLICE = 0.05
#: Longest single block of an awaiting event loop's thread in a backend (seconds): the loop's
#: other tasks wait at most this long at a time (gloo's timed wait counts whole milliseconds).
_AWAIT_SLICE = 1e-3


@dataclass(frozen=True)
class PollPolicy:
    """The settings of the idle decision (`Idling.idle`); docs/performance.md says which to
    change for which symptom.

    Attributes:
        spin_polls: idle polls a waiter spins before it yields, when spinning is safe.
        burst: direct tests of the request a poll focuses on, when it is the only one in
            flight and its backend moves data only while tested (MPI), in one hold of the
            lock, which other threads wait for at most that long (`Engine.poll`); 0: none,
            every poll walks the tracks. Between bursts the waiter returns to its driver,
            and MPI moves nothing meanwhile: fewer, longer bursts finish medium and large
            messages sooner (docs/performance.md).
        yield_seconds: how long a waiter yields the CPU between polls before it sleeps (an
            awaiting task hands the wait to the background thread instead).
        block_seconds: how long a waiter polls a lone operation whose backend can block
            (gloo) before it blocks in the backend instead.
        block_bytes: a lone operation on such a backend moving at least this many bytes is
            blocked on at once: its polls would only take the CPU from gloo's threads.
        await_block_seconds: how long an ``await`` blocks in such an operation in slices in
            its own thread before it hands it to the background thread, which blocks in it
            while the loop sleeps. Longer than ``block_seconds``: a hand-off costs a thread
            switch each way.
        sleep_fraction: a waiter's sleep lasts this fraction of the time waited so far...
        sleep_max: ...but never longer than this (seconds).
        background_min, background_max: the background thread's poll interval bounds; it
            doubles while nothing finishes and resets when something does.
        background_nap_max: the longest nap of the background thread while it finds
            nothing to poll (no work in flight, or a caller that drives or keeps submitting).
            Each such nap doubles the next, from ``background_max``; a poll, a wait handed
            over to it or a wake from its deep sleep resets it. None (the default), or
            anything up to ``background_max``: no doubling (``nap_max``). The runtime raises
            it where the ranks fill the node's cores, one rank a core: there each wake takes a
            rank's core and its GIL, and polls during compute only move MPI's CPU work onto
            the compute's own core. The price: the polls of work left in flight start up to
            ``nap_max`` later (a submission does not wake a napping thread).
        deep_idle: seconds without work after which the background thread sleeps until a
            submission wakes it.
        oversubscribed: more ranks than cores on this node: never spin; and a waiter for an
            operation of a self-progressing backend (gloo) naps ``give_way_seconds`` where it
            would yield the CPU between polls, so that other ranks' gloo threads, which move
            its data, get the CPU (a waiter for MPI still yields: naps slowed small MPI
            operations there).
        give_way_seconds: that nap.
    """

    spin_polls: int = 64
    burst: int = 32
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

    @property
    def nap_max(self) -> float:
        """The background thread's longest nap: ``background_nap_max``, never below
        ``background_max``."""
        if self.background_nap_max is None:
            return self.background_max
        return max(self.background_nap_max, self.background_max)

    @property
    def patience(self) -> float:
        """Seconds a waiter yields between polls before it may sleep or block: none on an
        oversubscribed node, where yielding polls take the CPU that self-progressing backends'
        threads need."""
        return 0.0 if self.oversubscribed else self.yield_seconds

    @property
    def block_patience(self) -> float:
        """Seconds a waiter polls a lone gloo operation before blocking in it: polls find
        short operations sooner than a timed wait, but polling a long one takes the CPU from
        gloo's own threads."""
        return min(self.block_seconds, self.patience)

    def block_after(self, nbytes: int) -> float:
        """Seconds a waiter polls a lone gloo operation of ``nbytes`` before blocking in it."""
        return 0.0 if nbytes >= self.block_bytes else self.block_patience

    def nap(self, waited: float) -> float:
        """How long a waiter that has waited ``waited`` seconds sleeps before its next poll."""
        return min(self.sleep_max, max(waited, 1e-4) * self.sleep_fraction)


class Idling:
    """The engine's idle decision and deadlines (a part of `Engine`)."""

    if not TYPE_CHECKING:  # (the engine declares the slots: it has no __dict__)
        __slots__ = ()

    _policy: PollPolicy
    _burst: range
    _clock: Callable[[], float]
    _track_list: list[Track]
    _unfinished: int
    _deferred: dict[Names, None]
    _comms: dict[str, CommState]
    _thread: ProgressThread | None
    _next_check: float
    _lock: threading.Lock
    drivers: int
    last_active: float
    timeout: float | None
    idle_hook: Callable[[], None] | None
    _zombies: dict[CommFuture, None]
    _on_timeout: Callable[[list[CommFuture]], Callable[[], None] | None] | None

    if TYPE_CHECKING:  # the engine's other parts
        def _lone(self, fut: CommFuture) -> CommFuture | None: ...
        def check_signals(self) -> None: ...
        def _bury(self, fut: CommFuture) -> bool: ...
        def agreements(self) -> list[Names]: ...
        def _give_up(self, fut: CommFuture, error: BaseException) -> None: ...
        def _run_work(self) -> None: ...
        def _after_lock(self) -> None: ...

    def idle(self, fut: CommFuture, waited: float, polls: int,
             driver: int) -> tuple[int, float]:
        """What a ``driver`` (``WAIT`` or ``AWAIT``) waiting for ``fut`` does before its next
        poll, after ``polls`` polls in a row that moved nothing, ``waited`` seconds into its
        wait (from its first such poll). Deadlines are checked here once spinning is over."""
        policy = self._policy
        if polls <= policy.spin_polls and self.spin_ok():
            return SPIN, 0.0
        lone = self._lone(fut)
        self.check_deadlines(self._clock())
        if fut._state >= DONE:  # (failed by a deadline just now)
            return SPIN, 0.0
        if self.idle_hook is not None:
            return SCHEDULE, 0.0
        if self.needs_polls():
            return self._give_way(fut)
        if (lone is not None and lone.lane.blocking
                and waited >= policy.block_after(fut.nbytes)):
            if driver == AWAIT:
                if waited >= policy.await_block_seconds and self._thread is not None:
                    return HAND_OFF, 1.0
                return BLOCK, _AWAIT_SLICE
            return BLOCK, _BLOCK_SLICE
        if waited < policy.patience:
            return self._give_way(fut)
        if driver == AWAIT and self._thread is not None:
            return HAND_OFF, 0.0
        return SLEEP, policy.nap(waited)

    def _give_way(self, fut: CommFuture) -> tuple[int, float]:
        """Let other threads run before the next poll for ``fut``: ``sched_yield``; but on an
        oversubscribed node, for an operation of a self-progressing backend (gloo), a nap, so
        that the other ranks' gloo threads that move its data get the CPU."""
        policy = self._policy
        if policy.oversubscribed and fut.lane.track.self_progressing:
            return GIVE_WAY, policy.give_way_seconds
        return GIVE_WAY, 0.0

    def idle_background(self, quiet: float, parks: int, polls: int, polled: bool,
                        lone: CommFuture | None = None) -> tuple[int, float]:
        """The background thread's next step: ``quiet`` seconds since it last saw work,
        ``parks`` parks in a row for lack of anything to poll (each doubles the next, up to
        ``nap_max``), ``polls`` polls in a row that moved nothing (each doubles the pause
        after the next, up to ``background_max``); ``polled``: it just polled, and asks how
        long to pause (deadlines are checked then: a timeout or a peer's death surfaces while the
        caller computes, not only when some thread waits). ``lone``: a wait an awaiting task
        handed over, to block in while it is the lone operation of a backend that can block
        and no waiter drives (BLOCK; anything else: the hand-over is over)."""
        policy = self._policy
        if lone is not None:
            target = None if self.drivers or lone._state >= DONE else self._lone(lone)
            if target is None or not target.lane.blocking:
                return SPIN, 0.0
            self.check_deadlines(self._clock())
            return BLOCK, _BLOCK_SLICE
        if polled:
            self.check_deadlines(self._clock())
            return SLEEP, min(policy.background_min * 2 ** min(polls, 30),
                              policy.background_max)
        nap = min(policy.background_max * 2 ** min(parks, 30), policy.nap_max)
        if not self._unfinished:
            return WAIT_WORK, -1.0 if quiet > policy.deep_idle else nap
        if self.drivers or self._clock() - self.last_active < policy.background_max:
            # A waiter drives, or the caller is busy submitting and waiting: polling now
            # would only fight it for the GIL and the lock.
            return PARK, nap
        return POLL, 0.0

    def spin_ok(self) -> bool:
        """Whether a waiter may spin: no in-flight backend needs the CPU for its own threads."""
        if self._policy.oversubscribed:
            return False
        for track in self._track_list:
            if track.self_progressing and track.live:
                return False
        return True

    def needs_polls(self) -> bool:
        """Whether a backend whose data moves only while it is polled (MPI) has work in
        flight: then a waiter must not sleep, since a sleeping poller stalls the transfer."""
        for track in self._track_list:
            if track.live and not track.self_progressing:
                return True
        return False

    @property
    def has_background(self) -> bool:
        """Whether a background progress thread polls while nobody waits."""
        return self._thread is not None

    def wake_background(self, lone: CommFuture | None = None) -> None:
        """Let the background thread poll (an awaiting task handed its wait over).

        ``lone``: the only operation in flight, on a backend that can block; the thread
        blocks in the backend until it finishes instead of polling.
        """
        thread = self._thread
        if thread is not None:
            if lone is not None:
                thread.lone = lone
            thread.wanted = True  # (before reading parked: a park starting now sees it)
            if thread.parked:
                thread.wake()

    # -- deadlines -----------------------------------------------------------------------

    def check_deadlines(self, now: float) -> None:
        """Apply outside signals (``check_signals``); then, at most every ``timeout / 8``
        (0.25 s at most), bury zombies whose backend has finished with them, fail issued
        operations older than ``timeout`` with CommTimeoutError, and named operations that
        waited for agreement that long with DesyncError."""
        self.check_signals()
        if now < self._next_check:
            return
        timeout = self.timeout
        self._next_check = now + self._check_interval()
        with self._lock:
            for zombie in list(self._zombies):
                self._bury(zombie)
            if timeout is None:
                return
            limit = now - timeout
            named: dict[Names, list[CommFuture]] = {}
            for names in self.agreements():
                if names.comm.broken is None:
                    futs = names.expired(limit)
                    if futs:
                        named[names] = futs
            expired = [f for t in self._track_list for f, _ in t.items() if f.t_issue < limit]
            if not expired and not named:
                return
            timed_out = with_carried(expired)  # (what they carry times out with them)
            # The hook sees them before they are given up (the flight recorder's view of the
            # stuck state), and what it returns runs once the lock is released.
            report = (None if self._on_timeout is None else self._on_timeout(
                [f for futs in named.values() for f in futs] + timed_out))
            # Named operations first, so that theirs is the cause the peers hear of: fail
            # them with DesyncError naming the members that lack them, and break their
            # communicators (the members do not agree on what runs next).
            for names, futs in named.items():
                names.fail([(f, DesyncError(names.why(f, timeout))) for f in futs])
            for fut in expired:
                why = fut.lane.backend.describe_wait(fut._request)
                what = f"{fut.kind}#{fut.seq}"
                if fut.stream is not None and fut.stream[0] == ANY_PEER:
                    what += f" from any rank, tag {fut.stream[1]},"
                    why = why or "no rank has sent it a message of that tag"
                elif fut.stream is not None:  # a send or receive: its peer and tag
                    peer, tag, sends = fut.stream
                    what += f" {'to' if sends else 'from'} rank {peer}, tag {tag},"
                    why = why or (f"rank {peer} has not posted the matching "
                                  f"{'receive' if sends else 'send'}, or it has not arrived")
                self._give_up(fut, CommTimeoutError(
                    f"{what} on lane {fut.lane.backend_name}:{fut.lane.comm_name} "
                    f"(rank {fut.lane.rank} of {fut.lane.size}) did not finish within "
                    f"{timeout:g} s of being issued; "
                    f"{why or 'the peers it needs have not all arrived'}"
                ))
            self._run_work()
        self._after_lock()
        if report is not None:
            report()

    def _check_interval(self) -> float:
        timeout = self.timeout
        return 0.25 if timeout is None else min(timeout / 8, 0.25)

    def deadlines(self) -> list[float]:
        """The times (on the engine's clock) at which the engine has something to do that no
        poll finds by itself: a deferred agreement round is due, an issued operation or a
        named one waiting for agreement times out (one check interval late at most). The
        simulated world lets its clock run to the earliest when nothing else can move."""
        due = [names.later for names in self._deferred if names.later is not None]
        timeout = self.timeout
        if timeout is not None:
            since = [f.t_issue for t in self._track_list for f, _ in t.items()]
            since += [ready for names in self.agreements()
                      for _, ready in names.held.values() if ready is not None]
            late = timeout + self._check_interval()
            due += [t + late for t in since]
        return due
