"""The progress engine: the only code that issues operations, tests requests and resolves futures.

One engine per runtime. Operations arrive through ``submit`` with their lane, their byte
ranges and their explicit ``after=`` edges; the engine turns those into DAG edges (see
``_hazards``), issues each lane's operations in submission order once their dependencies have
finished, and resolves futures as the backends report completion in ``poll_once``. Everything
that mutates engine state runs under one lock, so that a backend is only ever called by one
thread at a time (MPI can then run at thread level SERIALIZED, which halves its small-message
cost here). Who calls ``poll_once`` is the drivers' business (``_drivers``): the thread that
waits, an asyncio task that awaits, or the background thread while nobody waits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import (
    BackendError,
    CommAbortedError,
    CommTimeoutError,
    DesyncError,
    MCRDLError,
    DependencyFailedError,
    FutureCancelledError,
    InvalidStateError,
    RuntimeFinalizedError,
)
from . import _drivers
from ._future import CANCELLED, DONE, FAILED, ISSUED, PENDING, STATE_NAMES, CommFuture
from ._hazards import HazardIndex
from ._lanes import Lane, flight_record
from ._tracks import Track

if TYPE_CHECKING:
    from ..backends import Backend

__all__ = ["Engine", "EngineStats"]

#: Tests of a lone request per hold of the lock in Engine.spin_lone (a lock round trip
#: costs as much as a test; other threads wait at most a burst for the lock).
_BURST = 8

Ranges = tuple[tuple[int, int], ...]

#: What an operation leaves behind when it fails while issued (timed out, aborted) and its
#: backend cannot cancel it: its request and the objects it used by address. The backend may
#: still read or write that memory (MPI collectives cannot be cancelled), so these stay alive
#: for the rest of the process instead of being freed under it.
_ABANDONED: list[tuple[Any, Any, Any]] = []


def _abandon(fut: CommFuture) -> None:
    """Keep what issued ``fut`` may still have in use by its backend (before it settles)."""
    _ABANDONED.append((fut._request, getattr(fut, "_hold", None), fut._result))


@dataclass(frozen=True)
class EngineStats:
    """Counters of one engine since it started.

    Attributes:
        submitted, issued, completed, failed, cancelled: operations by what happened to them.
        pending: submitted, not yet issued (waiting for dependencies or their lane).
        in_flight: issued, not yet finished.
        polls: calls of ``poll_once`` that ran (took the lock).
        lanes: lanes created.
    """

    submitted: int
    issued: int
    completed: int
    failed: int
    cancelled: int
    pending: int
    in_flight: int
    polls: int
    lanes: int


class Engine:
    """Issues operations in lane order as their dependencies finish, and resolves their futures.

    Invariants:
    - ``poll_once`` and every state change run under ``_lock``; callbacks run after it is
      released.
    - every unfinished future is in exactly one place: its lane's ``pending`` (PENDING) or its
      backend's ``_Track`` (ISSUED); ``_unfinished`` counts them.
    - dependency edges point from a future to futures submitted before it (rule 3 of DESIGN.md),
      so the wait-for graph of a rank is acyclic.
    - the hazard index holds the ranges of every unfinished operation except ``_unindexed``,
      which is the newest submitted one (so the index always holds a prefix of submissions).
    """

    def __init__(
        self,
        *,
        policy: _drivers.PollPolicy | None = None,
        background: bool = True,
        timeout: float | None = None,
        on_timeout: Callable[[list[CommFuture], str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._hazards = HazardIndex()
        self._tracks: dict[Backend, Track] = {}
        self._track_list: list[Track] = []
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._due: list[tuple[Callable[[CommFuture], object], CommFuture]] = []
        self._work: deque[tuple[CommFuture, BaseException | None]] = deque()
        # The newest operation, if it was issued at once and is unfinished, has its ranges
        # recorded only when the next one arrives: a program that waits for each operation
        # before the next never pays for the hazard index.
        self._unindexed: CommFuture | None = None
        self._unfinished = 0
        self._closed = False
        self._closed_why = ""
        self._policy = policy or _drivers.PollPolicy()
        #: Seconds an issued operation may stay unfinished before it fails (None: forever).
        self.timeout = timeout
        self._on_timeout = on_timeout
        self._next_check = 0.0
        self._abort_reason: str | None = None
        #: Number of threads or tasks driving progress in a wait right now.
        self.drivers = 0
        #: When the caller last submitted or stopped waiting (the background thread keeps out
        #: of a caller that is busy with the engine).
        self.last_active = 0.0
        #: Called by a waiter instead of yielding the CPU between idle polls (the simulated
        #: world hands control to its scheduler here, and its ranks progress only there: no
        #: lone spin then); None in real runs.
        self.idle_hook: Callable[[], None] | None = None
        # The bursts of spin_lone: none on an oversubscribed node (the policy is fixed).
        self._lone_bursts = range(0 if self._policy.oversubscribed
                                  else self._policy.lone_spins // _BURST)
        # Counters: submitted and issued are derived in stats() (two fewer increments per op).
        self._n_completed = self._n_failed = self._n_cancelled = self._n_polls = 0
        self._n_dropped = 0  # failed or cancelled before they were issued
        self._thread: _drivers.ProgressThread | None = (
            _drivers.ProgressThread(self) if background else None
        )

    @property
    def policy(self) -> _drivers.PollPolicy:
        """How drivers idle between polls; fixed when the engine is made."""
        return self._policy

    # -- lanes ---------------------------------------------------------------------------

    def lane(self, backend: Backend, group: Any, comm_name: str) -> Lane:
        """The lane of ``backend`` on the communicator ``comm_name`` (made on first use)."""
        key = (backend.name, comm_name)
        lane = self._lanes.get(key)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(key)
                if lane is None:
                    lane = self._lanes[key] = Lane(backend, group, comm_name)
                    track = self._tracks.get(backend)
                    if track is None:
                        track = self._tracks[backend] = Track(backend)
                        self._track_list.append(track)
                    lane.track = track
        return lane

    def lanes(self) -> list[Lane]:
        """Every lane, in creation order."""
        return list(self._lanes.values())

    @property
    def lock(self) -> threading.Lock:
        """The engine's lock: hold it for any direct call into a backend outside the engine."""
        return self._lock

    # -- submission ----------------------------------------------------------------------

    def submit(
        self,
        kind: str,
        lane: Lane,
        seq: int,
        start: Callable[..., Any],
        args: tuple[Any, ...],
        reads: Ranges,
        writes: Ranges,
        result: Any,
        finish: Callable[[CommFuture], None] | None = None,
        after: Iterable[CommFuture] = (),
        nbytes: int = 0,
        hold: Any = None,
    ) -> CommFuture:
        """Add an operation; issue it at once if its lane and dependencies allow.

        ``start(*args)`` issues it and returns the backend's request; ``reads`` and ``writes``
        are the byte ranges it touches; ``result`` is what the future resolves to; ``finish``
        runs on success before the future resolves (e.g. the division of an emulated AVG).
        ``hold`` is what else must stay alive until the operation finishes: the caller's
        objects whose memory the backend reads or writes by address (MPI), other than
        ``result``. ``start`` and ``args`` are released once the operation is issued: an
        operation in flight keeps two objects fewer for the garbage collector to scan.
        """
        if after:
            after = self._check_after(after)
        self.last_active = now = self._clock()
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise RuntimeFinalizedError(
                    f"cannot submit {kind}: the runtime was finalized ({self._closed_why})"
                )
            self._unfinished += 1
            hazards = self._hazards
            last = self._unindexed
            if last is not None:
                # The previous operation is still unfinished: its ranges matter now.
                self._unindexed = None
                if last._reads or last._writes:
                    hazards.add(last, last._reads, last._writes)
            # (the index's dict read directly: a __bool__ call would cost a frame per submit)
            deps = hazards.conflicts(reads, writes) if hazards._regions else None
            if not deps and not after and not lane.pending:
                # Issue first, then make the future and record the ranges: the network starts
                # sooner (the peers' messages are on their way while this runs), and under the
                # lock nobody sees the difference (a completion is only queued here, so the
                # ranges are in place before anything settles).
                try:
                    req = start(*args)
                except Exception as exc:  # fails the future, not the process
                    fut = CommFuture(self, kind, lane, seq, start, args, reads, writes, result,
                                     finish, nbytes, now)
                    self._start_failed(fut, exc)
                else:
                    fut = CommFuture(self, kind, lane, seq, None, None, reads, writes, result,
                                     finish, nbytes, now)
                    if hold is not None:  # (set only where there is one: most have none)
                        fut._hold = hold
                    self._issued(fut, req, now)
                self._unindexed = fut
                if self._work:
                    self._run_work()
            else:
                fut = CommFuture(self, kind, lane, seq, start, args, reads, writes, result,
                                 finish, nbytes, now)
                if hold is not None:
                    fut._hold = hold
                if after:
                    deps = self._after_edges(fut, after, deps)
                if deps is None and after:
                    self._run_work()  # an after= dependency failed already: fut fails with it
                elif not deps and not lane.pending:
                    self._issue(fut)
                    self._unindexed = fut
                    if self._work:
                        self._run_work()
                else:
                    if reads or writes:
                        hazards.add(fut, reads, writes)
                    if deps:
                        fut._deps_left = len(deps)
                        for dep in deps:
                            dependants = dep._dependants
                            if dependants is None:
                                dep._dependants = [fut]
                            else:
                                dependants.append(fut)
                    lane.pending.append(fut)
        finally:
            lock.release()
        if self._due:
            self._flush_due()
        thread = self._thread
        if thread is not None and thread.deep:
            thread.wake()
        return fut

    def _check_after(self, after: Iterable[CommFuture]) -> tuple[CommFuture, ...]:
        after = tuple(after)
        for dep in after:
            if not isinstance(dep, CommFuture):
                raise TypeError(
                    f"after= takes CommFutures, got {type(dep).__qualname__}: {dep!r}"
                )
            if dep._engine is not self:
                raise ValueError(f"after= got {dep!r}, a future of another runtime")
        return after

    def _after_edges(
        self, fut: CommFuture, after: Iterable[CommFuture], deps: dict[CommFuture, None] | None
    ) -> dict[CommFuture, None] | None:
        """Add ``after=`` edges to ``deps``; None (and ``fut`` failed) if one failed already."""
        deps = dict(deps) if deps else {}
        for dep in after:
            state = dep._state
            if state < DONE:
                deps[dep] = None
            elif state != DONE:
                self._work.append((fut, DependencyFailedError(
                    f"{fut.kind}#{fut.seq} on {fut.lane.backend_name} depends on "
                    f"{dep.kind}#{dep.seq}, which {STATE_NAMES[state].lower()}: {dep._error}"
                )))
                return None
        return deps

    # -- issuing and settling (lock held) ------------------------------------------------

    def _issue(self, fut: CommFuture) -> None:
        try:
            req = fut._start(*fut._args)  # type: ignore[misc]  # both set until issued
        except Exception as exc:  # a backend refusing at start fails the future, not the process
            self._start_failed(fut, exc)
            return
        fut._args = None  # what stays alive in flight is _hold
        self._issued(fut, req, self._clock())

    def _issued(self, fut: CommFuture, req: Any, now: float) -> None:
        """Record that ``fut`` was issued at ``now`` and gave ``req`` (None: finished)."""
        fut.t_issue = now
        fut._state = ISSUED
        fut._start = None  # one object fewer alive per operation in flight
        if req is None:  # finished during the start call
            self._work.append((fut, None))
            return
        fut._request = req
        fut.lane.track.add(fut, req)

    def _start_failed(self, fut: CommFuture, exc: Exception) -> None:
        err = BackendError(f"{fut.kind}#{fut.seq} on {fut.lane.backend_name} failed to start: {exc}")
        err.__cause__ = exc
        self._work.append((fut, err))

    def _pump(self, lane: Lane) -> None:
        """Issue the lane's head operations, in order, while their dependencies are met."""
        pending = lane.pending
        while pending:
            head = pending[0]
            if head._state != PENDING:  # failed or cancelled while waiting: skip it
                pending.popleft()
                continue
            if head._deps_left:
                return
            pending.popleft()
            self._issue(head)

    def _run_work(self) -> None:
        """Settle the queued completions, and everything they release, iteratively."""
        work = self._work
        while work:
            fut, error = work.popleft()
            self._settle(fut, error)

    def _settle(self, fut: CommFuture, error: BaseException | None) -> None:
        """Finish ``fut``: run its finishing step, resolve it, release what depends on it."""
        state = fut._state
        if error is None and state == ISSUED and fut._finish is None:
            # The common case, kept short: every line here runs once per operation.
            fut.t_done = now = self._clock()
            if fut is self._unindexed:
                self._unindexed = None
            elif fut._reads or fut._writes:
                self._hazards.remove(fut, fut._reads, fut._writes, True)
            self._unfinished -= 1
            self._n_completed += 1
            fut._state = DONE
            fut.lane.history.append((fut.kind, fut.seq, DONE, fut.nbytes, fut.t_submit,
                                     fut.t_issue, now, ""))
            fut._hold = fut._request = None  # release buffers and scratch space now
            callbacks = fut._callbacks
            fut._callbacks = None
            if callbacks:
                self._due.extend((cb, fut) for cb in callbacks)
            if fut._dependants:
                self._release(fut, None)
            return
        if state >= DONE:
            return
        if error is None and fut._finish is not None:
            try:
                fut._finish(fut)
            except MCRDLError as exc:  # the runtime's own verdict (e.g. DesyncError): as is
                error = exc
            except Exception as exc:
                error = BackendError(f"{fut.kind}#{fut.seq}: finishing step failed: {exc}")
                error.__cause__ = exc
        fut.t_done = now = self._clock()
        if fut is self._unindexed:
            self._unindexed = None
        elif fut._reads or fut._writes:
            self._hazards.remove(fut, fut._reads, fut._writes, error is None)
        self._unfinished -= 1
        lane = fut.lane
        if error is None:
            fut._state = DONE
            self._n_completed += 1
        else:
            if state == PENDING:
                self._n_dropped += 1
            if isinstance(error, FutureCancelledError):
                fut._state = CANCELLED
                self._n_cancelled += 1
            else:
                fut._state = FAILED
                self._n_failed += 1
            fut._error = error
            fut._result = None
        lane.history.append((fut.kind, fut.seq, fut._state, fut.nbytes, fut.t_submit,
                             fut.t_issue, now, ""))
        fut._start = fut._args = fut._hold = fut._request = None
        callbacks = fut._callbacks
        fut._callbacks = None
        if callbacks:
            self._due.extend((cb, fut) for cb in callbacks)
        if state == PENDING and lane.pending and lane.pending[0] is fut:
            self._pump(lane)
        if fut._dependants:
            self._release(fut, error)

    def _release(self, fut: CommFuture, error: BaseException | None) -> None:
        """Tell ``fut``'s dependants it finished: issue the ready ones, or fail them all."""
        dependants = fut._dependants
        fut._dependants = None
        if error is None:
            for dep in dependants:  # type: ignore[union-attr]
                dep._deps_left -= 1
                if dep._deps_left == 0 and dep._state == PENDING:
                    dlane = dep.lane
                    if dlane.pending and dlane.pending[0] is dep:
                        self._pump(dlane)
            return
        for dep in dependants:  # type: ignore[union-attr]
            if dep._state < DONE:
                if isinstance(error, DesyncError):  # the check's verdict is the op's own
                    failure: BaseException = DesyncError(f"{dep.kind}#{dep.seq}: {error}")
                else:
                    failure = DependencyFailedError(
                        f"{dep.kind}#{dep.seq} on {dep.lane.backend_name} depends on "
                        f"{fut.kind}#{fut.seq}, which {STATE_NAMES[fut._state].lower()}: "
                        f"{error}"
                    )
                self._work.append((dep, failure))

    def _flush_due(self) -> None:
        due, self._due = self._due, []
        for cb, fut in due:
            cb(fut)

    # -- progress ------------------------------------------------------------------------

    def poll_once(self) -> bool:
        """Test every backend's in-flight requests once and resolve what finished.

        Returns True if anything finished. Returns False at once if another thread is
        polling (the lock is busy): that thread is making the same progress.
        """
        lock = self._lock
        if not lock.acquire(False):
            return False
        try:
            self._n_polls += 1
            progressed = False
            for track in self._track_list:
                if not track.live:
                    continue
                finished = track.poll()
                if not finished:
                    continue
                progressed = True
                if len(finished) == 1 and not self._work:
                    self._settle(*finished[0])
                else:
                    self._work.extend(finished)
                if self._work:
                    self._run_work()
        finally:
            lock.release()
        if self._due:
            self._flush_due()
        return progressed

    def spin_lone(self, fut: CommFuture) -> bool:
        """``poll_once`` while ``fut`` is the only unfinished operation, ``lone_spins`` times.

        Then every track but ``fut``'s is empty and ``fut``'s holds its request alone, so one
        poll is one test of that request: this tests it directly (the backend's ``test_one``),
        without walking the tracks, and settles it as ``poll_once`` would. Only where spinning
        is safe: not for a self-progressing backend (its threads need the CPU), not on an
        oversubscribed node, not in a simulated world (its ranks progress only in the idle
        hook). Returns True once ``fut`` is done; False at once where it may not spin, after
        ``lone_spins`` tests, or as soon as another operation arrives or another thread holds
        the lock (the caller then polls the general way). A 4-byte
        MPI allreduce's ``.wait()`` at 2 ranks went from +5.0 to +3.4 µs over a raw blocking
        call this way (20,000 alternated pairs).
        """
        lane = fut.lane
        if (fut._state != ISSUED or self._unfinished != 1 or not lane.spins_alone
                or self.idle_hook is not None):
            return False
        lock = self._lock
        track = lane.track
        test = track.backend.test_one
        request = fut._request
        burst = range(_BURST)
        for _ in self._lone_bursts:  # none on an oversubscribed node
            if not lock.acquire(False):
                return False
            try:
                if self._unfinished != 1 or fut._state != ISSUED:
                    return fut._state >= DONE
                self._n_polls += _BURST
                # A burst of tests under one hold of the lock: nothing can change meanwhile.
                error: BaseException | None = None
                try:
                    for _ in burst:
                        if test(request):
                            break
                    else:
                        continue  # not finished: release the lock (finally), then go on
                except BackendError as exc:
                    error = exc
                except Exception as exc:  # noqa: BLE001 - a backend's failure fails the future
                    error = BackendError(f"{fut.kind}#{fut.seq} on {fut.lane.backend_name}: {exc}")
                    error.__cause__ = exc
                # Track.empty(), written out (the settling of every lone wait runs this):
                # fut's request was the track's only live entry.
                track.futs = []
                track.reqs = []
                track.first = track.live = track.rot = 0
                if error is None and fut._finish is None and fut is self._unindexed:
                    # _settle's common case, written out for the commonest wait of all: a
                    # call level here is ~0.1 µs of every small lone .wait() (20,000
                    # alternated pairs at 2 ranks: +4.5 -> +4.4 µs over raw MPI allreduce).
                    self._unindexed = None
                    fut.t_done = now = self.last_active = self._clock()
                    self._unfinished -= 1
                    self._n_completed += 1
                    fut._state = DONE
                    lane.history.append((fut.kind, fut.seq, DONE, fut.nbytes, fut.t_submit,
                                         fut.t_issue, now, ""))
                    fut._hold = fut._request = None
                    callbacks = fut._callbacks
                    fut._callbacks = None
                    if callbacks:
                        self._due.extend((cb, fut) for cb in callbacks)
                    if fut._dependants:
                        self._release(fut, None)
                else:
                    self._settle(fut, error)
                    self.last_active = fut.t_done
                if self._work:
                    self._run_work()
            finally:
                lock.release()
            if self._due:
                self._flush_due()
            return True
        return False

    def in_flight(self) -> int:
        """Operations submitted and not yet finished (issued or not)."""
        return self._unfinished

    def needs_polls(self) -> bool:
        """Whether a backend whose data moves only while it is polled (MPI) has work in flight.

        Then a waiter must not sleep: a sleeping poller stalls the transfer itself (a 64 MiB
        MPI allreduce took twice as long with sleeps between polls).
        """
        for track in self._track_list:
            if track.live and not track.self_progressing:
                return True
        return False

    def spin_ok(self) -> bool:
        """Whether a waiter may spin: no in-flight backend needs the CPU for its own threads."""
        if self._policy.oversubscribed:
            return False
        for track in self._track_list:
            if track.self_progressing and track.live:
                return False
        return True

    def drive_async(self, fut: CommFuture) -> Generator[Any, None, None]:
        """The body of ``await fut``: poll from the running event loop until ``fut`` is done."""
        if self._closed and fut._state < DONE:
            raise RuntimeFinalizedError(
                f"cannot await {fut!r}: the runtime was finalized ({self._closed_why})"
            )
        return _drivers.drive_async(self, fut)

    @property
    def has_background(self) -> bool:
        """Whether a background progress thread polls while nobody waits."""
        return self._thread is not None

    def wake_background(self, lone: CommFuture | None = None) -> None:
        """Let the background thread poll (called when a driver leaves with work in flight).

        ``lone``: the only unfinished operation, on a backend that can block; the thread
        blocks in the backend until it finishes instead of polling.
        """
        thread = self._thread
        if thread is not None:
            if lone is not None:
                thread.lone = lone
            if thread.parked:
                thread.wake()

    def request_abort(self, reason: str) -> None:
        """Fail every unfinished operation with CommAbortedError at the next idle check.

        Safe from a signal handler: it only sets a flag (the handler may interrupt a thread
        that holds the engine's lock).
        """
        self._abort_reason = reason

    def check_deadlines(self, now: float) -> None:
        """Fail issued operations older than ``timeout`` with CommTimeoutError (rate-limited)."""
        if self._abort_reason is not None:
            reason, self._abort_reason = self._abort_reason, None
            self.fail_all(lambda f: CommAbortedError(f"{f.kind}#{f.seq} on lane "
                                                     f"{f.lane.backend_name}:{f.lane.comm_name}"
                                                     f" aborted: {reason}"))
        timeout = self.timeout
        if timeout is None or now < self._next_check:
            return
        self._next_check = now + min(timeout / 8, 0.25)
        limit = now - timeout
        with self._lock:
            expired = [f for t in self._track_list for f, _ in t.items() if f.t_issue < limit]
            if not expired:
                return
            record = flight_record(self)
            for fut in expired:
                track = fut.lane.track
                request = track.remove(fut)
                why = track.backend.describe_wait(request) or "the peers it needs have not all arrived"
                if not track.backend.cancel(request):
                    _abandon(fut)
                self._work.append((fut, CommTimeoutError(
                    f"{fut.kind}#{fut.seq} on lane {fut.lane.backend_name}:{fut.lane.comm_name} "
                    f"(rank {fut.lane.rank} of {fut.lane.size}) did not finish within "
                    f"{timeout:g} s of being issued; {why}"
                )))
            self._run_work()
        self._flush_due()
        if self._on_timeout is not None:
            self._on_timeout(expired, record)

    # -- cancellation --------------------------------------------------------------------

    def cancel(self, fut: CommFuture) -> bool:
        """See `CommFuture.cancel`."""
        with self._lock:
            state = fut._state
            if state >= DONE:
                return False
            if state == ISSUED:
                backend = fut.lane.backend
                if not backend.capabilities.cancel or not backend.cancel(fut._request):
                    raise InvalidStateError(
                        f"cannot cancel {fut!r}: it was issued already and "
                        f"{backend.name} cannot cancel issued operations"
                    )
                fut.lane.track.remove(fut)
            self._work.append((fut, FutureCancelledError(f"{fut.kind}#{fut.seq} was cancelled")))
            self._run_work()
        self._flush_due()
        return True

    # -- shutdown ------------------------------------------------------------------------

    def fail_all(self, make_error: Callable[[CommFuture], BaseException]) -> int:
        """Fail every unfinished future with ``make_error(fut)``; returns how many."""
        with self._lock:
            victims: list[CommFuture] = []
            for track in self._track_list:
                for fut in track.clear():  # issued: the backend may still use their memory
                    _abandon(fut)
                    victims.append(fut)
            for lane in self._lanes.values():
                victims.extend(f for f in lane.pending if f._state == PENDING)
                lane.pending.clear()
            for fut in victims:
                self._work.append((fut, make_error(fut)))
            self._run_work()
        self._flush_due()
        return len(victims)

    def close(self, why: str) -> None:
        """Refuse further submissions and stop the background thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closed_why = why
        if self._thread is not None:
            self._thread.stop()

    @property
    def closed(self) -> bool:
        """True once ``close`` ran."""
        return self._closed

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters."""
        with self._lock:
            in_flight = sum(t.live for t in self._track_list)
            finished = self._n_completed + self._n_failed + self._n_cancelled
            submitted = finished + self._unfinished
            pending = self._unfinished - in_flight
            return EngineStats(
                submitted=submitted,
                issued=submitted - pending - self._n_dropped,
                completed=self._n_completed,
                failed=self._n_failed,
                cancelled=self._n_cancelled,
                pending=pending,
                in_flight=in_flight,
                polls=self._n_polls,
                lanes=len(self._lanes),
            )

    def unfinished(self) -> list[CommFuture]:
        """Every unfinished future: issued ones by backend, then pending ones by lane."""
        with self._lock:
            out = [f for t in self._track_list for f, _ in t.items()]
            out.extend(f for lane in self._lanes.values() for f in lane.pending if f._state == PENDING)
            return out
