"""The progress engine's core path: submit, issue, settle and poll, each written once.

One engine per runtime, and the only code that issues operations, tests requests and resolves
futures. Operations arrive through ``submit`` as `CommFuture` descriptors with their explicit
``after=`` edges; the engine turns their byte ranges into DAG edges (`_hazards`), issues each
lane's operations in submission order once the one test, ``_may_issue``, allows, and
resolves futures as the backends report completion in ``poll``. Everything that changes
engine state runs under one lock, so that a backend is only ever called by one thread at a
time (MPI can then run at thread level SERIALIZED). Who polls, and how they idle between
polls, is the drivers' business (`_drivers`), carrying out the one decision of `_idle`.

Every operation ends in ``_settle``, whatever ends it: completion, a backend's error, a failed
dependency, cancellation, a timeout, or its communicator breaking. What a failure
means for the operation's peers (rule 7: its communicator breaks) is `_breaks`; how device
work is ordered by events (rule 6) is `_events`; how named operations get their places
(rule 8) is `_names`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..core._errors import (
    BackendError,
    CommTimeoutError,
    DependencyFailedError,
    DesyncError,
    FutureCancelledError,
    MCRDLError,
    RuntimeFinalizedError,
    StartError,
)
from ._breaks import Breaks
from ._edges import Edges
from ._events import Events
from ._future import CommFuture, Placement, report_callback_error
from ._hazards import HazardIndex
from ._idle import Idling, PollPolicy
from ._lanes import CommState, Lane, Stops
from ._places import EngineStats, Places, Route
from ._states import CANCELLED, CHECK_KIND, DONE, FAILED, ISSUED, PENDING, STATE_NAMES
from ._tracks import Track

if TYPE_CHECKING:
    from ..backends import Backend
    from ._drivers import ProgressThread
    from ._names import Names

__all__ = ["Engine", "EngineStats"]

Observer = Callable[[CommFuture, tuple[CommFuture, ...]], None]


def _profile(profiler: Any, fut: CommFuture) -> None:
    """Record ``fut`` in the running torch profiler: a ``record_function`` range named
    ``mcrdl.<op>`` from its submission to its completion (a torch future the range ends on,
    completed by the operation's callback, on whichever thread settles it)."""
    import torch

    rf = profiler.record_function(
        f"mcrdl.{fut.kind}", f"{fut.lane.key} {fut.nbytes} B #{fut.seq}")
    rf.__enter__()
    done: torch.futures.Future[None] = torch.futures.Future()
    rf._call_end_callbacks_on_future(done)
    rf.__exit__(None, None, None)
    fut.add_done_callback(lambda _: done.set_result(None))


class Engine(Places, Edges, Breaks, Events, Idling):
    """Issues operations in lane order as their dependencies finish, and resolves their futures.

    Invariants:
    - ``poll`` and every state change run under ``_lock``; callbacks run after it is
      released.
    - every unfinished future is in exactly one place: its lane's ``pending`` (PENDING; a
      routed one in each of its candidate lanes' until it is routed), its backend's
      ``Track`` (ISSUED), the ``carried`` list of a future in a Track (ISSUED, fused into
      it), or its communicator's `Names` (PENDING, not yet agreed on); ``_unfinished``
      counts them.
    - dependency edges point from a future to futures submitted before it (rule 3 of
      docs/design.md), so the wait-for graph of a rank is acyclic.
    - the hazard index holds the ranges of every unfinished operation and every zombie.
    - ``_zombies`` are FAILED futures whose requests are not yet finished in their backend.
    """

    # Those every operation reads first: slots are laid out in this order, so the ones a
    # submission and a settle read share a few cache lines.
    __slots__ = (
        "_lock", "_clock", "_observers", "wait_observer", "torch_profiler", "_closed", "_unfinished",
        "_hazards", "_zombies", "_work", "_due", "_to_tell", "_thread", "last_active",
        "_n_completed", "log", "drivers", "_burst", "idle_hook", "_deferred", "_gated",
        "_track_list", "_n_polls", "_policy", "_closed_why", "_tracks", "_lanes", "_comms",
        "timeout", "_on_timeout", "_next_check", "_told", "_lost",
        "_told_early", "gone",
        "on_break", "_n_failed", "_n_cancelled", "_n_dropped", "log_edges", "waiting",
        "on_fault", "on_heard",
    )

    def __init__(
        self,
        *,
        policy: PollPolicy | None = None,
        background: bool = True,
        timeout: float | None = None,
        on_timeout: Callable[[list[CommFuture]], Callable[[], None] | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        from ._drivers import ProgressThread

        self._lock = threading.Lock()
        self._clock: Callable[[], float] = clock
        self._hazards = HazardIndex()
        self._tracks: dict[Backend, Track] = {}
        self._track_list: list[Track] = []
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._comms: dict[str, CommState] = {}
        self._due: list[tuple[Callable[[CommFuture], object], CommFuture]] = []
        self._work: deque[tuple[CommFuture, BaseException | None]] = deque()
        self._observers: list[Observer] = []
        #: Called with each operation a thread or task starts to wait for (``wait()``,
        #: ``await``), finished or not, before it waits: what a recording keeps of the
        #: program's order (`mcrdl.testing.record`). None: nobody records.
        self.wait_observer: Callable[[CommFuture], None] | None = None
        self._zombies: dict[CommFuture, None] = {}
        self._unfinished = 0
        self._closed = False
        self._closed_why = ""
        self._policy = policy or PollPolicy()
        #: Direct tests of a lone request per poll (`Idling`): none on an oversubscribed
        #: node, where spinning takes the CPU from the other ranks.
        self._burst = (range(0) if self._policy.oversubscribed
                       else range(max(0, self._policy.burst - 1)))
        #: Seconds an issued operation may stay unfinished before it fails (None: forever).
        self.timeout = timeout
        #: Called with the operations about to time out, under the lock and before they are
        #: given up; what it returns runs once the lock is released (the runtime writes the
        #: flight recorder as it stood).
        self._on_timeout = on_timeout
        self._next_check = 0.0
        #: Peers' stops on broken communicators, not yet applied (filled from any thread):
        #: (communicator, cause, the peer's rank there, its stops).
        self._told: deque[tuple[str, str, int, Stops]] = deque()
        #: Processes the launcher told are gone, not yet applied (filled from any thread):
        #: (world rank, cause).
        self._lost: deque[tuple[int, str]] = deque()
        #: The world ranks whose process the launcher told is gone, with how it ended (filled
        #: as those notices are applied; a communicator made later with one of them is
        #: born broken).
        self.gone: dict[int, str] = {}
        #: Those of communicators this rank has not made yet: applied when it is made.
        self._told_early: dict[str, list[tuple[str, int, Stops]]] = {}
        #: Host-lane operations on device buffers whose events are not yet reached (gates).
        self._gated: list[CommFuture] = []
        #: Named operations' agreements with a round to post later (`Names.later`).
        self._deferred: dict[Names, None] = {}
        #: This rank's stops, to tell the peers of once the lock is released.
        self._to_tell: list[tuple[CommState, str, Stops]] = []
        #: Tells a break's peers (the runtime's notices): ``on_break(comm, cause, stops)``,
        #: called without the lock; None where nobody needs telling.
        self.on_break: Callable[[CommState, str, Stops], None] | None = None
        #: Number of threads or tasks driving progress in a wait right now.
        self.drivers = 0
        #: When the caller last submitted or stopped waiting (the background thread keeps out
        #: of a caller that is busy with the engine).
        self.last_active = 0.0
        #: Carried out instead of idling (the simulated world hands control to its scheduler
        #: here, and its ranks progress only there); None in real runs.
        self.idle_hook: Callable[[], None] | None = None
        self._n_completed = self._n_failed = self._n_cancelled = self._n_polls = 0
        self._n_dropped = 0  # failed or cancelled before they were issued
        #: Every finished operation's record, while the comms log is on (`mcrdl.observe`):
        #: (lane, kind, seq, state, nbytes, dtype, t_submit, t_issue, t_done); None: off.
        self.log: list[tuple[Any, ...]] | None = None
        #: Cross-lane dependencies while the log is on: (lane, seq, lane, seq), first's first.
        self.log_edges: list[tuple[Any, ...]] = []
        #: Futures a thread or task waits for past its first polls (the flight recorder's
        #: "waiting on"); appended and removed by the drivers.
        self.waiting: list[CommFuture] = []
        #: Called (after the lock) with an operation that failed with DesyncError (its
        #: members disagree) or BackendError (its backend failed it): the flight recorder.
        self.on_fault: Callable[[CommFuture], None] | None = None
        #: Called under the lock with a communicator a peer broke, its cause and the peer,
        #: before this rank fails anything for it (the flight recorder's view of what was
        #: stuck); what it returns runs once the lock is released.
        self.on_heard: Callable[[CommState, str, int], Callable[[], None] | None] | None = None
        #: torch.autograd.profiler where torch is loaded (set by the runtime): while torch's
        #: profiler runs, each operation is a range in its trace (`_profile`).
        self.torch_profiler: Any = None
        self._thread: ProgressThread | None = ProgressThread(self) if background else None

    @property
    def policy(self) -> PollPolicy:
        """How drivers idle between polls; fixed when the engine is made."""
        return self._policy

    @property
    def lock(self) -> threading.Lock:
        """The engine's lock: hold it for any direct call into a backend outside the engine."""
        return self._lock

    def now(self) -> float:
        """The engine's clock (seconds): the one its futures' times are read on."""
        return self._clock()

    def observe(self, fn: Observer) -> Callable[[], None]:
        """Call ``fn(fut, after)`` for every operation submitted from now on, before it is
        issued (its descriptor complete); returns a function that stops the calls.

        Observers run in the submitting thread, without the engine's lock; they must not
        submit operations.
        """
        with self._lock:
            self._observers = [*self._observers, fn]

        def stop() -> None:
            with self._lock:
                self._observers = [o for o in self._observers if o is not fn]

        return stop

    # -- submission ----------------------------------------------------------------------

    def submit(self, fut: CommFuture, after: Iterable[CommFuture] = (),
               route: tuple[tuple[Lane, ...], Callable[[CommFuture], None]] | None = None,
               named: tuple[Names, str] | None = None) -> CommFuture:
        """Add the operation ``fut`` describes; issue it at once if nothing holds it back.
        Returns ``fut``.

        ``route``: for an operation whose lane is known only once its dependencies have
        finished, the candidate lanes and ``choose(fut)``, which then sets ``fut.lane``,
        ``fut.start`` and ``fut.args`` (a `Route`). ``named``: ``(names, signature)`` for an
        operation its members match by ``fut.name`` (rule 8): it takes its place in the
        hazard DAG now, and its place in ``fut.lane`` (a named lane) once its dependencies
        have finished and the members have agreed on it (`Names`).
        """
        if after:
            after = self._check_after(after)
        if self._observers:
            for observer in self._observers:
                observer(fut, after)  # type: ignore[arg-type]
        fut._engine = self
        profiler = self.torch_profiler
        if profiler is not None and profiler._is_profiler_enabled:
            _profile(profiler, fut)
        fut.t_submit = self.last_active = now = self._clock()
        if fut.device is not None:
            self._caller_event(fut)  # (in the caller's thread: its current stream)
        lane = fut.lane
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise RuntimeFinalizedError(
                    f"cannot submit {fut.kind}: the runtime was finalized ({self._closed_why})"
                )
            placement: Placement | None = None
            if named is not None:
                named[0].hold(fut, named[1])
                placement = fut._placement = named[0]
            elif route is not None:
                placement = fut._placement = Route(self, fut, *route)
            else:  # (a placement gives it its position later)
                fut.index = lane.take(fut.stream)
            self._unfinished += 1
            hazards = self._hazards
            deps = hazards.conflicts(fut)
            if lane.comm.broken is not None:
                self._work.append((fut, self._broken_error(fut)))
            elif not (after or (deps and self._zombies)) or (
                    (deps := self._edges(fut, after, deps)) is not None):  # type: ignore[arg-type]
                if deps and lane.stream is not None and placement is None:
                    deps = self._on_device(fut, deps)
                # A host lane, or a lane not chosen yet, waits on the host for device events.
                if fut.waits is not None and (lane.stream is None or type(placement) is Route):
                    fut._deps_left = 1
                    self._gated.append(fut)
                if deps:
                    self._depend(fut, deps)
                if placement is None:
                    if self._may_issue(fut):
                        self._issue(fut, now)
                    else:
                        lane.pending.append(fut)
                        if fut.reads or fut.writes:
                            hazards.add(fut)
                else:
                    if fut.reads or fut.writes:
                        hazards.add(fut)
                    if not fut._deps_left:
                        placement.ready(fut)
            if self._work:
                self._run_work()
        finally:
            lock.release()
        if self._due or self._to_tell:
            self._after_lock()
        thread = self._thread
        if thread is not None and thread.deep:
            thread.wake()
        return fut

    def add_own(self, fut: CommFuture) -> None:
        """Submit ``fut``, an operation the engine makes itself (a `Names` agreement round):
        placed at the end of its lane at once (it has no ranges and no dependencies); lock
        held."""
        fut._engine = self
        fut.t_submit = self._clock()
        self._unfinished += 1
        self.place([fut])

    def _may_issue(self, fut: CommFuture) -> bool:
        """Whether ``fut`` may be issued now, the one test of it: its dependencies have
        finished, it has its place, nothing submitted before it on its lane waits to be
        issued, and, a collective, its lane's issue window has room. Issue in submission
        order per lane, never "whichever is ready first": MPI and NCCL match collectives by
        call order, and ready-first lets two ranks issue one lane's collectives in different
        orders (tests/sim/test_policies.py shows the hang). A send or receive is never held
        back by the window: a receive waiting for a send behind it would never end."""
        lane = fut.lane
        pending = lane.pending
        return (not fut._deps_left and fut._placement is None
                and (not pending or pending[0] is fut)
                and (fut.stream is not None or lane.issued < lane.window))

    # -- issuing and settling (lock held) ------------------------------------------------

    def _issue(self, fut: CommFuture, now: float) -> None:
        """Start ``fut`` (at ``now``); a start that fails fails it. On a lane with a stream,
        the stream first waits on ``fut.waits``, and ``fut.event`` marks its end there. What
        is fused into it is in flight from now on, with it."""
        lane = fut.lane
        stream = lane.stream
        if stream is not None and fut.waits is not None:
            for event in fut.waits:
                lane.device.wait(stream, event)
        try:
            req = fut.start(*fut.args)  # type: ignore[misc]  # both set until issued
        except DesyncError as exc:  # every member refuses it alike (the counts they agreed
            self._work.append((fut, exc))  # on do not fit): they stay in step, unbroken
            return
        except Exception as exc:  # a backend refusing at start fails the future, not the process
            err = StartError(f"{fut.kind}#{fut.seq} on {lane.backend_name} failed to "
                             f"start: {exc}")
            err.__cause__ = exc
            self._work.append((fut, err))
            return
        # In flight from now on, with what is fused into it (its members have no request).
        for one in (fut,) if fut.carried is None else (fut, *fut.carried):
            if one._state == PENDING:
                one.start = one.args = None  # what stays alive in flight is hold
                one.t_issue = now
                one._state = ISSUED
                if one.stream is None:
                    one.lane.issued += 1
        if stream is not None:
            fut.waits = None
            fut.event = lane.device.record(stream)
        if req is None:  # finished during the start call
            self._work.append((fut, None))
            return
        fut._request = req
        lane.track.add(fut, req)

    def _pump(self, lane: Lane) -> None:
        """Issue the lane's head operations, in order, while ``_may_issue`` allows."""
        broken = lane.comm.broken is not None
        pending = lane.pending
        while pending:
            head = pending[0]
            if head._state != PENDING:  # failed or cancelled while waiting: skip it
                pending.popleft()
                continue
            if broken or not self._may_issue(head):
                return  # (on a broken lane its pending operations are failing already)
            self._issue(head, self._clock())
            if head._state == PENDING:
                # Its start failed: the lane waits for that failure to settle (which breaks
                # the communicator) instead of issuing what follows in its place.
                return
            pending.popleft()
            if head._dependants is not None and head.event is not None:
                self._enqueued(head)

    def _run_work(self) -> None:
        """Settle the queued endings, and everything they release, iteratively."""
        work = self._work
        while work:
            fut, error = work.popleft()
            self._settle(fut, error)

    def _settle(self, fut: CommFuture, error: BaseException | None) -> None:
        """Finish ``fut``: run its finishing step, resolve it, release what depends on it."""
        state = fut._state
        if state >= DONE:
            return
        if fut.finish is not None:
            if error is None:
                try:
                    fut.finish(fut)
                except MCRDLError as exc:  # the runtime's own verdict (a DesyncError): as is
                    error = exc
                except Exception as exc:
                    error = BackendError(f"{fut.kind}#{fut.seq}: finishing step failed: {exc}")
                    error.__cause__ = exc
            fut.finish = None  # (an emulated AVG's holds its tensor)
        if state == PENDING:
            fut.start = fut.args = None
        fut.t_done = now = self._clock()
        zombie = error is not None and fut in self._zombies
        if fut.reads or fut.writes:
            if zombie:  # its backend may still write them: they stay until it is buried
                self._hazards.keep(fut)
            else:
                self._hazards.remove(fut, error is None)
        self._unfinished -= 1
        lane = fut.lane
        if state == ISSUED and fut.stream is None:
            lane.issued -= 1
        if error is None:
            fut._state = DONE
            self._n_completed += 1
            fut._on_stream = None
        else:
            if isinstance(error, BackendError) and lane.size > 1:
                error = self._as_lost(fut, error)
            if state == PENDING:
                self._n_dropped += 1
            if isinstance(error, FutureCancelledError):
                fut._state = CANCELLED
                self._n_cancelled += 1
            else:
                fut._state = FAILED
                self._n_failed += 1
            fut._error = error
            if self.on_fault is not None and isinstance(error, (DesyncError, BackendError)):
                self._due.append((self.on_fault, fut))
            if zombie:  # its backend may still write the result: keep it with the rest
                fut.hold = (fut.hold, fut._result)
            fut._result = None
        lane.history.append((fut.kind, fut.seq, fut._state, fut.nbytes, fut.t_submit,
                             fut.t_issue, now, ""))
        if self.log is not None:
            self._log(fut, lane, now)
        if not zombie:
            fut.hold = fut._request = None  # release the buffers now
        callbacks = fut._callbacks
        fut._callbacks = None
        if callbacks:
            self._due.extend((cb, fut) for cb in callbacks)
        if error is not None:
            self._failed(fut, error, state)  # its dependants, and its peers (rule 7)
        if state == PENDING:
            placement = fut._placement
            if placement is not None:
                fut._placement = None
                placement.drop(fut)
            elif lane.pending and lane.pending[0] is fut:
                self._pump(lane)
        elif lane.pending:  # its place in the lane's window is free (after any break)
            self._pump(lane)
        if fut._dependants:
            self._release(fut, None)
        if fut.carried is not None:
            self._end_carried(fut, error)

    def _log(self, fut: CommFuture, lane: Lane, now: float) -> None:
        """Append ``fut``'s record to the comms log (on; lock held). Its result's dtype is
        read now: the record must not keep the result alive."""
        result = fut._result
        self.log.append((lane, fut.kind, fut.seq, fut._state, fut.nbytes,  # type: ignore[union-attr]
                         getattr(result, "dtype", None), fut.t_submit, fut.t_issue, now))

    def _release(self, fut: CommFuture, error: BaseException | None) -> None:
        """Tell ``fut``'s dependants it ended: issue the ready ones, or fail them all."""
        dependants = fut._dependants
        fut._dependants = None
        if error is None:
            for dep in dependants:  # type: ignore[union-attr]
                self._dep_done(dep)
            return
        # Debug mode's check of an operation's fingerprint: its verdict (a desync, or the
        # peers not arriving in time) is the operation's own.
        verdict = isinstance(error, DesyncError) or (
            fut.kind == CHECK_KIND and isinstance(error, CommTimeoutError))
        for dep in dependants:  # type: ignore[union-attr]
            if dep._state < DONE:
                if verdict:
                    failure: BaseException = type(error)(f"{dep.kind}#{dep.seq}: {error}")
                else:
                    failure = DependencyFailedError(
                        f"{dep.kind}#{dep.seq} on {dep.lane.backend_name} depends on "
                        f"{fut.kind}#{fut.seq}, which {STATE_NAMES[fut._state].lower()}: "
                        f"{error}"
                    )
                self._work.append((dep, failure))

    def _dep_done(self, dep: CommFuture) -> None:
        """One of ``dep``'s dependencies is met: issue (or place) it if it was the last."""
        dep._deps_left -= 1
        if dep._deps_left == 0 and dep._state == PENDING:
            placement = dep._placement
            if placement is not None:
                placement.ready(dep)
                return
            lane = dep.lane
            if lane.pending and lane.pending[0] is dep:
                self._pump(lane)

    def _end_carried(self, carrier: CommFuture, error: BaseException | None) -> None:
        """``carrier`` ended: the operations fused into it end with it (`_fusion`): their
        bytes are back, or they fail as it did, as issued (their peers ran them as this rank
        did; a break it caused is broken already)."""
        carried, carrier.carried = carrier.carried, None
        for fut in carried:  # type: ignore[union-attr]
            fut.carrier = None
            if fut._state != ISSUED:
                continue  # never carried (the carrier failed to start): the break fails it
            if error is None:
                self._work.append((fut, None))
                continue
            text = (f"{fut.kind}#{fut.seq} on {fut.lane.backend_name} ran fused into "
                    f"{carrier.kind}#{carrier.seq}, which "
                    f"{STATE_NAMES[carrier._state].lower()}: {error}")
            # The carrier's kind of error (a timeout, finalize, a backend's failure).
            failure = (type(error)(text) if isinstance(error, MCRDLError)
                       else DependencyFailedError(text))
            failure.__cause__ = error
            self._work.append((fut, failure))

    # -- progress ------------------------------------------------------------------------

    def poll(self, focus: CommFuture | None = None) -> bool:
        """Test the in-flight requests once and settle what finished; True if anything did.

        ``focus``: the operation the caller waits for. When its request is the only one in
        flight and nothing else can move meanwhile (``_lone``), and its backend moves data
        only while tested, the poll is a burst of up to ``PollPolicy.burst`` direct tests of that
        request under one hold of the lock: a test costs a fraction of a walk over every
        track. Returns
        False at once if another thread is polling (the lock is busy): that thread is making
        the same progress.
        """
        lock = self._lock
        if not lock.acquire(False):
            return False
        try:
            self._n_polls += 1
            lone = None if focus is None or not self._burst else self._lone(focus)
            if lone is not None and lone.lane.spins_alone:
                progressed = True
                test = lone.lane.track.backend.test_one
                request = lone._request
                self._n_polls += len(self._burst)
                error: BaseException | None = None
                try:
                    # The first test stands alone: it is the one that finds most small
                    # operations done, and a loop costs more than the test.
                    if not test(request):
                        for _ in self._burst:
                            if test(request):
                                break
                        else:
                            progressed = False
                except MCRDLError as exc:  # (as ``test`` reports it: BackendError, or
                    error = exc            # DesyncError for a receive of a short message)
                except Exception as exc:  # noqa: BLE001 - a backend's failure fails it
                    error = BackendError(
                        f"{lone.kind}#{lone.seq} on {lone.lane.backend_name}: {exc}")
                    error.__cause__ = exc
                if progressed:
                    lone.lane.track.empty()  # its request was the track's only live entry
                    self._settle(lone, error)
                    if self._work:
                        self._run_work()
            else:
                progressed = False
                if self._deferred:
                    self._post_deferred()
                if self._gated and self._open_gates():
                    progressed = True
                for track in self._track_list:
                    if not track.live:
                        continue
                    finished = track.poll()
                    if finished:
                        progressed = True
                        self._work.extend(finished)
                        self._run_work()
        finally:
            lock.release()
        if self._due or self._to_tell:
            self._after_lock()
        return progressed

    def _lone(self, fut: CommFuture) -> CommFuture | None:
        """The operation whose request is ``fut``'s (``fut``, or the carrier it is fused
        into) if that request is the only one in flight and only its end can move anything:
        every other unfinished operation waits behind it, no agreement round is due and no
        device event is awaited. Then waiting for ``fut`` may test that request alone, or
        block in its backend (lock held, or read without it by a deciding driver)."""
        carrier = fut.carrier
        if carrier is not None:
            fut = carrier
        if (fut._state != ISSUED or fut.lane.track.live != 1 or self._deferred
                or self._gated):
            return None
        if self._unfinished != 1:  # the others must all wait to be issued
            track = fut.lane.track
            for other in self._track_list:
                if other.live and other is not track:
                    return None
        return fut

    def block(self, fut: CommFuture, seconds: float) -> None:
        """Block in the backend of ``fut``'s request, while it is the lone one (``_lone``),
        for up to ``seconds``; then poll, which settles it if it ended. Called without the
        lock, by a driver carrying out the decision to block (`Idling.idle`)."""
        lone = self._lone(fut)
        # Read without the lock: a thread issuing it just now sets its state before its
        # request.
        request = None if lone is None else getattr(lone, "_request", None)
        if request is not None:
            lone.lane.backend.block(request, seconds)  # type: ignore[union-attr]
        self.poll()

    def _post_deferred(self) -> None:
        now = self._clock()
        for names in list(self._deferred):
            if names.later is None:
                del self._deferred[names]
            elif now >= names.later:
                del self._deferred[names]
                names.due(now)
        self._run_work()

    # -- after the lock ------------------------------------------------------------------

    def _after_lock(self) -> None:
        """What an entry point does once it released the lock, where anything became due:
        run the callbacks, tell peers of breaks."""
        if self._due:
            with self._lock:  # appended under it: swapping under it loses none
                due, self._due = self._due, []
            for cb, fut in due:
                try:
                    cb(fut)
                except Exception:  # noqa: BLE001 - a callback's failure is reported, not ours
                    report_callback_error(cb, fut)
        if self._to_tell:
            with self._lock:
                to_tell, self._to_tell = self._to_tell, []
            if self.on_break is not None:
                for comm, cause, stops in to_tell:
                    self.on_break(comm, cause, stops)

    # -- shutdown ------------------------------------------------------------------------

    def close(self, why: str) -> None:
        """Refuse further submissions and stop the background thread; idempotent.

        Zombies still unfinished keep their requests and memory for the rest of the process.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closed_why = why
            self._abandon()
        if self._thread is not None:
            self._thread.stop()

    @property
    def closed(self) -> bool:
        """True once ``close`` ran."""
        return self._closed
