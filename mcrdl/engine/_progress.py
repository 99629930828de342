"""The progress engine: the only code that issues operations, tests requests and resolves futures.

One engine per runtime. Operations arrive through ``submit`` as `CommFuture` descriptors with
their explicit ``after=`` edges; the engine turns their byte ranges into DAG edges (see
``_hazards``), issues each lane's operations in submission order once their dependencies have
finished, and resolves futures as the backends report completion in ``poll_once``. Everything
that mutates engine state runs under one lock, so that a backend is only ever called by one
thread at a time (MPI can then run at thread level SERIALIZED, which halves its small-message
cost here). Who calls ``poll_once`` is the drivers' business (``_drivers``): the thread that
waits, an asyncio task that awaits, or the background thread while nobody waits.

Every operation ends in ``_settle``, whatever ends it: completion, a backend's error, a failed
dependency, cancellation, a timeout, an abort, or its communicator breaking. ``_settle`` is
also where docs/design.md's rule 7 is applied: an operation that will not run as issued breaks its
communicator (see `CommState`).

Device work (docs/design.md rule 6) is ordered by events, never by a host wait in the poll loop. An
operation on device buffers carries the event of the caller's current stream at submission
(``fut.waits``). On a lane with a stream (a stream-ordered backend), the lane's stream waits
on that event and the operation is queued there; the event recorded after it (``fut.event``)
marks its end. A dependency between two such operations on one device is met when the first
is *queued*: the second's stream waits on the first's event (``_enqueued``). Every other
dependency is met when the first has finished, as seen by the host; and an operation of a host
lane (MPI, gloo) on device buffers is issued only once the engine has seen its events reached
(its *gate*, queried as it polls).

Issued operations the engine gives up on (timed out, aborted, their communicator broken) while
their backend cannot cancel them become *zombies*: their future fails, but their request, the
memory they use and their byte ranges stay with the engine until the backend reports them
finished (MPI collectives cannot be cancelled, and may still write their output). A new
operation on such bytes fails at once instead of racing the backend's late writes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core._errors import (
    BackendError,
    CommAbortedError,
    CommBrokenError,
    CommTimeoutError,
    DependencyFailedError,
    DesyncError,
    FutureCancelledError,
    InvalidStateError,
    MCRDLError,
    RuntimeFinalizedError,
    StartError,
)
from ..core._forever import forever
from . import _drivers
from ._future import (
    CANCELLED,
    DONE,
    FAILED,
    ISSUED,
    PENDING,
    STATE_NAMES,
    CommFuture,
    report_callback_error,
)
from ._hazards import HazardIndex
from ._lanes import CommState, Lane, Stops
from ._tracks import Track

if TYPE_CHECKING:
    from ..backends import Backend
    from ._names import Names

__all__ = ["Engine", "EngineStats"]

#: Tests of a lone request per hold of the lock in Engine.spin_lone (a lock round trip
#: costs as much as a test; other threads wait at most a burst for the lock).
_BURST = 8
_REST_OF_BURST = range(_BURST - 1)

#: Errors that mean an issued operation will not run as its peers expect, so that it breaks
#: its communicator like an operation that was never issued: the engine gave up on it
#: (timed out, aborted, finalized, cancelled), or it never started (a backend's worker
#: thread could not start it). Any other error a backend reports is the operation's own.
_NOT_AS_ISSUED = (CommTimeoutError, CommAbortedError, RuntimeFinalizedError,
                  FutureCancelledError, StartError)

#: Errors that end an unissued operation without breaking its communicator: it is broken
#: already, or debug mode refused the operation, which every member does alike (they all
#: read the same fingerprints), so the members stay in step.
_IN_STEP = (CommBrokenError, DesyncError)

#: The kind of debug mode's fingerprint checks (``Communicator._checked``).
CHECK_KIND = "fingerprint"

#: The kind of a `Names` agreement round. One that fails here, in flight or in its finishing
#: step, breaks its communicator: its peers place what they agreed on, and this member no
#: longer knows what that is (rule 8 of docs/design.md).
AGREEMENT_KIND = "agreement"

#: Zombies left unfinished when their engine closed, with the monotonic time by which their
#: backend gives up on them: their requests and the memory their backends may still use are
#: kept for the rest of the process, past the interpreter's teardown (`forever`: MPI_Finalize
#: runs after it, and may still move their bytes).
_ABANDONED: list[tuple[CommFuture, float]] = forever([])
#: World ranks of the peers that, when an engine closed, had a send or receive toward this
#: rank that this rank never matched, on a backend that holds a thread for it (`linger`).
_WAITED_BY: set[int] = set()


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


def linger(before: Callable[[], None] = lambda: None) -> None:
    """Before the interpreter finalizes: wait until no abandoned operation holds a thread of
    this process blocked in its backend, or its backend's own timeout has passed; ``before``
    runs first if there is anything to wait for.

    Such a thread (gloo's ``Work.wait()`` for a send or receive no peer will match) wakes when
    the peer process exits and its connections close. If that happens while this interpreter
    finalizes, CPython before 3.14 ends the thread inside C++ and the process aborts
    ("terminate called without an active exception"). A peer with a lower world rank that
    itself waits for this rank (it has a send or receive toward this rank that this rank never
    matched) exits only after this process does, so it is not waited for: ordering by world
    rank, the waits cannot form a cycle.
    """
    waits = []
    for fut, limit in _ABANDONED:
        event = fut.lane.backend.thread_held(fut._request)
        if event is None:
            continue
        comm = fut.lane.comm
        if fut.stream is not None:
            peer = comm.members[fut.stream[0]]
            if peer < comm.members[comm.rank] and peer in _WAITED_BY:
                continue
        waits.append((limit, event))
    if waits:
        before()
    for limit, event in waits:
        event.wait(max(0.0, limit - time.monotonic()))


def _waited_by(comm: CommState) -> list[int]:
    """World ranks of the members of the broken ``comm`` that have a send or receive toward
    this rank that this rank never issued the match of, on a lane whose backend holds a thread
    for it (known from the stops they told)."""
    me = comm.rank
    lanes = [lane for lane in comm.lanes if lane.backend.capabilities.waits_in_threads]
    out = []
    for peer, stops in comm.stops.items():
        if peer == me:
            continue
        for lane in lanes:
            theirs = stops.get(lane.key)
            if theirs is not None and any(
                    dest == me and n - 1 > lane.streams.get((peer, tag, not sends), 0)
                    for (dest, tag, sends), n in theirs[1].items()):
                out.append(comm.members[peer])
                break
    return out

Observer = Callable[[CommFuture, tuple[CommFuture, ...]], None]


def _unmatched(fut: CommFuture, known: dict[int, Stops]) -> bool:
    """Whether a member whose stops are ``known`` will never match ``fut``: a collective at or
    past any member's stop on its lane; a send or receive at or past its peer's stop on the
    matching stream (the peer's receives from here, or sends to here, with that tag)."""
    key = fut.lane.key
    if fut.stream is None:
        for stops in known.values():
            lane = stops.get(key)
            if fut.index >= (lane[0] if lane is not None else 1):
                return True
        return False
    mine = known.get(fut.lane.rank, {}).get(key)  # this rank stopped it (an in-order lane)
    if mine is not None and fut.index >= mine[1].get(fut.stream, 1 << 62):
        return True
    peer, tag, sends = fut.stream
    theirs = known.get(peer)
    if theirs is None:
        return False  # not known yet: it tells when it stops
    lane = theirs.get(key)
    return fut.index >= (lane[1].get((fut.lane.rank, tag, not sends), 1) if lane else 1)


@dataclass(frozen=True)
class EngineStats:
    """Counters of one engine since it started.

    Attributes:
        submitted, issued, completed, failed, cancelled: operations by what happened to them.
        pending: submitted, not yet issued (waiting for dependencies or their lane).
        in_flight: issued, not yet finished.
        polls: calls of ``poll_once`` that ran (took the lock).
        lanes: lanes created.
        zombies: failed operations whose backend may still use their memory.
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
    zombies: int = 0


def _with_carried(futs: list[CommFuture]) -> list[CommFuture]:
    """``futs`` (issued), and the operations fused into them and in flight with them
    (`Engine._carry`)."""
    return futs + [m for f in futs if f.carried is not None for m in f.carried
                   if m._state == ISSUED]


class Engine:
    """Issues operations in lane order as their dependencies finish, and resolves their futures.

    Invariants:
    - ``poll_once`` and every state change run under ``_lock``; callbacks run after it is
      released.
    - every unfinished future is in exactly one place: its lane's ``pending`` (PENDING; a
      routed one in each of its candidate lanes' until it is routed), its backend's
      ``Track`` (ISSUED), or the ``carried`` list of a future in a Track (ISSUED, fused
      into it: `_carry`); ``_unfinished`` counts them.
    - dependency edges point from a future to futures submitted before it (rule 3 of docs/design.md),
      so the wait-for graph of a rank is acyclic.
    - the hazard index holds the ranges of every unfinished operation and every zombie except
      ``_unindexed``, the newest submitted one (so the index always holds a prefix of
      submissions).
    - ``_zombies`` are FAILED futures whose requests are not yet finished in their backend.
    """

    # Those every operation reads first: slots are laid out in this order, so the ones a
    # submission and a settle read share a few cache lines (they are read with the caches
    # cold whenever a large message has just gone through them).
    __slots__ = (
        "_lock", "_clock", "_observers", "torch_profiler", "_closed", "_unfinished",
        "_hazards", "_unindexed", "_zombies", "_work", "_due", "_to_tell", "_thread",
        "last_active", "_n_completed", "log", "drivers", "_lone_bursts", "idle_hook",
        "_deferred", "_gated", "_track_list", "_n_polls", "_policy",
        "_closed_why", "_tracks", "_lanes", "_comms", "timeout", "_on_timeout",
        "_next_check", "_abort_reason", "_told", "_told_early", "on_break", "_n_failed",
        "_n_cancelled", "_n_dropped", "log_edges", "waiting", "on_desync",
    )

    def __init__(
        self,
        *,
        policy: _drivers.PollPolicy | None = None,
        background: bool = True,
        timeout: float | None = None,
        on_timeout: Callable[[list[CommFuture]], Callable[[], None] | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._hazards = HazardIndex()
        self._tracks: dict[Backend, Track] = {}
        self._track_list: list[Track] = []
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._comms: dict[str, CommState] = {}
        self._due: list[tuple[Callable[[CommFuture], object], CommFuture]] = []
        self._work: deque[tuple[CommFuture, BaseException | None]] = deque()
        self._observers: list[Observer] = []
        self._zombies: dict[CommFuture, None] = {}
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
        #: Peers' stops on broken communicators, not yet applied (filled from any thread):
        #: (communicator, cause, the peer's rank there, its stops).
        self._told: deque[tuple[str, str, int, Stops]] = deque()
        #: Those of communicators this rank has not made yet (a peer may break one while
        #: this rank is still making it): applied when it is made.
        self._told_early: dict[str, list[tuple[str, int, Stops]]] = {}
        #: Host-lane operations on device buffers whose events are not yet reached (gates).
        self._gated: list[CommFuture] = []
        #: Named operations' agreements with a round to post later (`Names.due`).
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
        #: Every finished operation's record, while the comms log is on (`mcrdl.observe._recorder`):
        #: (lane, kind, seq, state, nbytes, dtype, t_submit, t_issue, t_done); None: off.
        self.log: list[tuple[Any, ...]] | None = None
        #: Cross-lane dependencies while the log is on: (lane, seq, lane, seq), first's first.
        self.log_edges: list[tuple[Any, ...]] = []
        #: Futures a thread or task is blocked waiting for past the first polls (the flight
        #: recorder's "waiting on"); appended and removed by the drivers.
        self.waiting: list[CommFuture] = []
        #: Called (after the lock) with an operation that failed with DesyncError.
        self.on_desync: Callable[[CommFuture], None] | None = None
        #: torch.autograd.profiler where torch is loaded (set by the runtime): while torch's
        #: profiler runs, each operation is a range in its trace (`_profile`).
        self.torch_profiler: Any = None
        self._thread: _drivers.ProgressThread | None = (
            _drivers.ProgressThread(self) if background else None
        )

    @property
    def policy(self) -> _drivers.PollPolicy:
        """How drivers idle between polls; fixed when the engine is made."""
        return self._policy

    # -- communicators and lanes ---------------------------------------------------------

    def comm(self, name: str, rank: int, size: int, members: Iterable[int] = ()) -> CommState:
        """The communicator ``name`` (made on first use): ``rank`` of ``size``, ``members``
        its world ranks in its rank order."""
        state = self._comms.get(name)
        if state is None:
            with self._lock:
                state = self._comms.get(name)
                if state is None:
                    state = self._comms[name] = CommState(name, rank, size, tuple(members))
                    for cause, peer, stops in self._told_early.pop(name, ()):
                        self._heard(state, cause, peer, stops)  # it broke before it was made
        return state

    def lane(self, backend: Backend, group: Any, comm: CommState, suffix: str = "",
             named: bool = False) -> Lane:
        """The lane of ``backend`` on ``comm`` (made on first use); ``suffix`` names a second
        lane of the same backend there (the debug lane, the named lane); ``named``: it runs
        named operations, in the order the members agree on (`Lane.named`)."""
        name = comm.name + suffix
        key = (backend.name, name)
        lane = self._lanes.get(key)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(key)
                if lane is None:
                    lane = self._lanes[key] = Lane(backend, group, comm, name, named)
                    comm.lanes.append(lane)
                    track = self._tracks.get(backend)
                    if track is None:
                        track = self._tracks[backend] = Track(backend)
                        self._track_list.append(track)
                    lane.track = track
        return lane

    def lanes(self) -> list[Lane]:
        """Every lane, in creation order."""
        return list(self._lanes.values())

    def agreements(self) -> list[Names]:
        """The named-operation agreements of the communicators that have them."""
        return [comm.names for comm in self._comms.values() if comm.names is not None]

    def now(self) -> float:
        """The engine's clock (seconds): the one its futures' times are read on."""
        return self._clock()

    def forget(self, comm: CommState) -> None:
        """Drop the closed communicator ``comm`` and its lanes (its operations have been
        waited for; a zombie keeps its own lane alive, for as long as it lives). A
        communicator made later under the same name starts afresh."""
        with self._lock:
            if self._comms.get(comm.name) is comm:
                del self._comms[comm.name]
            for lane in comm.lanes:
                key = (lane.backend_name, lane.comm_name)
                if self._lanes.get(key) is lane:
                    del self._lanes[key]

    @property
    def lock(self) -> threading.Lock:
        """The engine's lock: hold it for any direct call into a backend outside the engine."""
        return self._lock

    # -- observers -----------------------------------------------------------------------

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
        """Add the operation ``fut`` describes; issue it at once if its lane and its
        dependencies allow. Returns ``fut``.

        ``route``: for an operation whose lane is known only once its dependencies have
        finished, the candidate lanes (all of one communicator; ``fut.lane`` is a
        placeholder among them) and ``choose(fut)``, which then sets ``fut.lane``,
        ``fut.start`` and ``fut.args``. Meanwhile the operation holds its place in every
        candidate lane, so whichever it goes to, every member issues it at the same position
        there (rule 2 of docs/design.md): an alltoallv routed by its agreed total size waits for
        the exchange that agrees on it without blocking anything submitted before.

        ``named``: ``(names, signature)`` for an operation its members match by
        ``fut.name`` (rule 8): it takes its place in the hazard DAG now, and its place in
        ``fut.lane`` (a named lane) once its dependencies have finished and the members have
        agreed on it (`Names`).
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
            # Its position, which its peers match it by (rule 7 needs it when a member stops).
            stream = fut.stream
            if named is not None:  # its place comes with the members' agreement
                route = named[0]  # type: ignore[assignment]
                named[0].hold(fut, named[1])
            elif route is not None:  # a place in every candidate lane; the chosen one's counts
                reserved = {}
                for candidate in route[0]:
                    candidate.submitted = reserved[candidate] = candidate.submitted + 1
                route = (*route, reserved)  # type: ignore[assignment]
            elif stream is None:
                lane.submitted = fut.index = lane.submitted + 1
            else:
                lane.streams[stream] = fut.index = lane.streams.get(stream, 0) + 1
            self._unfinished += 1
            hazards = self._hazards
            last = self._unindexed
            if last is not None:
                # The previous operation is still unfinished: its ranges matter now.
                self._unindexed = None
                if last.reads or last.writes:
                    hazards.add(last, last.reads, last.writes)
            # (the index's dict read directly: a __bool__ call would cost a frame per submit)
            deps = hazards.conflicts(fut.reads, fut.writes) if hazards._regions else None
            if deps and self._zombies:
                self._past_zombies(deps)
            if lane.comm.broken is not None:
                self._work.append((fut, self._broken_error(fut)))
            elif (not deps and not after and not lane.pending and route is None
                  and (lane.issued < lane.window or stream is not None)
                  and (fut.waits is None or lane.stream is not None)):
                self._issue(fut, now)
                self._unindexed = fut
            else:
                fut._route = route
                self._enqueue(fut, deps, after)  # type: ignore[arg-type]
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

    def _enqueue(self, fut: CommFuture, deps: dict[CommFuture, None] | None,
                 after: tuple[CommFuture, ...]) -> None:
        """Queue ``fut`` behind its dependencies and its lane (or issue it, if nothing holds
        it back after all)."""
        if after or (deps and self._zombies):
            deps = self._edges(fut, after, deps)
            if deps is None:
                return  # a dependency failed already: fut fails with it (queued in _work)
        routed = fut._route is not None
        if deps and fut.lane.stream is not None and not routed:
            deps = self._on_device(fut, deps)
        # A host lane (or a lane not chosen yet) waits on the host for its device events.
        gated = fut.waits is not None and (fut.lane.stream is None or type(fut._route) is tuple)
        if (not deps and not routed and not gated and not fut.lane.pending
                and (fut.lane.issued < fut.lane.window or fut.stream is not None)):
            self._issue(fut, self._clock())
            self._unindexed = fut
            return
        if fut.reads or fut.writes:
            self._hazards.add(fut, fut.reads, fut.writes)
        if gated:
            fut._deps_left = 1
            self._gated.append(fut)
        if deps:
            fut._deps_left += len(deps)
            if self.log is not None:
                self.log_edges.extend((d.lane, d.seq, fut.lane, fut.seq) for d in deps
                                      if d.lane is not fut.lane)
            for dep in deps:
                dependants = dep._dependants
                if dependants is None:
                    dep._dependants = [fut]
                else:
                    dependants.append(fut)
        if routed:
            if type(fut._route) is tuple:
                for lane in fut._route[0]:
                    lane.pending.append(fut)
            if not deps and not gated:
                self._route(fut)
        else:
            fut.lane.pending.append(fut)

    def _check_after(self, after: Iterable[CommFuture]) -> tuple[CommFuture, ...]:
        after = tuple(after)
        for dep in after:
            if not isinstance(dep, CommFuture):
                raise TypeError(
                    f"after= takes CommFutures, got {type(dep).__qualname__}: {dep!r}"
                )
            if getattr(dep, "_engine", None) is not self:
                raise ValueError(f"after= got {dep!r}, a future of another runtime")
        return after

    def _edges(
        self, fut: CommFuture, after: tuple[CommFuture, ...],
        deps: dict[CommFuture, None] | None,
    ) -> dict[CommFuture, None] | None:
        """``deps`` with ``after=`` added; None (and ``fut`` failed) if one of them failed
        already, or is a zombie whose bytes ``fut`` touches."""
        deps = dict(deps) if deps else {}
        for dep in after:
            deps[dep] = None
        for dep in deps:
            state = dep._state
            if state < DONE:
                continue
            if state == DONE:  # an after= dependency that finished already
                continue
            if dep in self._zombies:
                why = (f"touches bytes that {dep.kind}#{dep.seq} on "
                       f"{dep.lane.backend_name} may still write: it was given up while "
                       f"issued ({dep._error}), and its backend cannot cancel it")
            else:
                why = (f"depends on {dep.kind}#{dep.seq}, which "
                       f"{STATE_NAMES[state].lower()}: {dep._error}")
            self._work.append((fut, DependencyFailedError(
                f"{fut.kind}#{fut.seq} on {fut.lane.backend_name} {why}")))
            return None
        return {dep: None for dep in deps if dep._state < DONE}

    def _past_zombies(self, deps: dict[CommFuture, None]) -> None:
        """Bury the zombies among ``deps`` whose backend has finished with them meanwhile;
        the others stay in ``deps`` (and fail the operation that touches their bytes)."""
        for dep in [d for d in deps if d in self._zombies]:
            if self._zombie_done(dep):
                del deps[dep]

    # -- device work (lock held, except _caller_event) -----------------------------------

    def _caller_event(self, fut: CommFuture) -> None:
        """``fut`` runs after the work the caller queued on its current stream so far."""
        device = fut.device
        fut.waits = [device.record(device.current_stream())]

    @staticmethod
    def _stream_edge(fut: CommFuture, dep: CommFuture) -> bool:
        """Whether ``fut`` may wait for ``dep`` on its stream, once ``dep`` is queued,
        instead of for ``dep``'s end on the host: both run on streams of one device, and all
        of ``dep`` runs there (no finishing step on the host)."""
        return (fut.lane.stream is not None and dep.lane.stream is not None
                and dep.lane.device is fut.lane.device and dep.finish is None)

    def _edge_event(self, fut: CommFuture, dep: CommFuture) -> None:
        """``fut``'s stream is to wait for the queued ``dep``'s end."""
        if fut.waits is None:
            fut.waits = [dep.event]
        else:
            fut.waits.append(dep.event)
        dep_list = dep._on_stream
        if dep_list is None:
            dep._on_stream = [fut]
        else:
            dep_list.append(fut)

    def _on_device(self, fut: CommFuture, deps: dict[CommFuture, None]
                   ) -> dict[CommFuture, None]:
        """``deps`` without those ``fut``'s stream can wait for already (queued on a stream
        of its device): their events join ``fut.waits``."""
        kept: dict[CommFuture, None] = {}
        for dep in deps:
            if dep._state == ISSUED and self._stream_edge(fut, dep):
                self._edge_event(fut, dep)
            else:
                kept[dep] = None
        return kept

    def _enqueued(self, fut: CommFuture) -> None:
        """``fut`` was queued on its lane's stream: its dependants that can wait for it on
        their own streams (`_stream_edge`) go on, their streams waiting on ``fut.event``."""
        keep = []
        for dep in fut._dependants:  # type: ignore[union-attr]
            if dep._state == PENDING and dep._route is None and self._stream_edge(dep, fut):
                self._edge_event(dep, fut)
                self._dep_done(dep)
            else:
                keep.append(dep)
        fut._dependants = keep or None

    def _open_gates(self) -> bool:
        """Let the gated operations whose device events have been reached go on; True if
        any did."""
        gated, self._gated = self._gated, []
        opened = False
        for fut in gated:
            if fut._state != PENDING:
                continue
            device = fut.device
            if all(device.query(event) for event in fut.waits):  # type: ignore[union-attr]
                fut.waits = None
                opened = True
                self._dep_done(fut)
            else:
                self._gated.append(fut)
        self._run_work()
        return opened

    # -- issuing and settling (lock held) ------------------------------------------------

    def _issue(self, fut: CommFuture, now: float) -> None:
        """Start ``fut`` (at ``now``); a start that fails fails it. On a lane with a stream,
        the stream first waits on ``fut.waits``, and ``fut.event`` marks its end there."""
        stream = fut.lane.stream
        if stream is not None and fut.waits is not None:
            device = fut.lane.device
            for event in fut.waits:
                device.wait(stream, event)
        try:
            req = fut.start(*fut.args)  # type: ignore[misc]  # both set until issued
        except Exception as exc:  # a backend refusing at start fails the future, not the process
            err = StartError(f"{fut.kind}#{fut.seq} on {fut.lane.backend_name} failed to "
                             f"start: {exc}")
            err.__cause__ = exc
            self._work.append((fut, err))
            return
        fut.start = fut.args = None  # what stays alive in flight is hold
        fut.t_issue = now
        fut._state = ISSUED
        if stream is not None:
            fut.waits = None
            fut.event = fut.lane.device.record(stream)
        if fut.stream is None:
            fut.lane.issued += 1
        if fut.carried is not None:
            self._carry(fut, now)
        if req is None:  # finished during the start call
            self._work.append((fut, None))
            return
        fut._request = req
        fut.lane.track.add(fut, req)

    def _carry(self, carrier: CommFuture, now: float) -> None:
        """``carrier`` was issued with the operations fused into it (`mcrdl.engine._fusion`):
        they are in flight from now on, in its lane's window, until it ends
        (`_end_carried`); `_pump` passes over them."""
        for fut in carrier.carried:  # type: ignore[union-attr]
            if fut._state == PENDING:
                fut.start = fut.args = None
                fut.t_issue = now
                fut._state = ISSUED
                fut.lane.issued += 1

    def _end_carried(self, carrier: CommFuture, error: BaseException | None) -> None:
        """``carrier`` ended: the operations it carried end with it (their bytes are back,
        or they fail as it did, as issued: their peers ran them as this rank did; a break
        it caused is broken already)."""
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

    def issued_locked(self) -> list[CommFuture]:
        """The issued, unfinished futures (the caller holds the lock): each track's, and what
        their carriers carry."""
        return _with_carried([f for t in self._track_list for f, _ in t.items()])

    def _pump(self, lane: Lane) -> None:
        """Issue the lane's head operations, in order, while their dependencies are met."""
        broken = lane.comm.broken is not None
        pending = lane.pending
        while pending:
            head = pending[0]
            if head._state != PENDING:  # failed or cancelled while waiting: skip it
                pending.popleft()
                continue
            if broken:
                return  # its pending operations are failing already: nothing is issued again
            if head._deps_left or head._route is not None:
                return
            if lane.issued >= lane.window and head.stream is None:
                return
            self._issue(head, self._clock())
            if head._state == PENDING:
                # Its start failed: the lane waits for that failure to settle (which breaks
                # the communicator) instead of issuing what follows in its place.
                return
            pending.popleft()
            if head._dependants is not None and head.event is not None:
                self._enqueued(head)

    def _route(self, fut: CommFuture) -> None:
        """``fut``'s dependencies are met: choose its lane, and let the others go on; or, for
        a named operation, offer it to its members' agreement."""
        if type(fut._route) is not tuple:
            fut._route.ready(fut)
            return
        lanes, choose, reserved = fut._route
        try:
            choose(fut)
        except Exception as exc:  # noqa: BLE001 - fails the operation, not the engine
            err = exc if isinstance(exc, MCRDLError) else BackendError(
                f"{fut.kind}#{fut.seq}: choosing its backend failed: {exc}")
            if err is not exc:
                err.__cause__ = exc
            self._work.append((fut, err))  # (its settle takes it out of the lanes)
            return
        fut._route = None
        fut.index = reserved[fut.lane]
        self._unroute(fut, [lane for lane in lanes if lane is not fut.lane])
        self._pump(fut.lane)

    def _unroute(self, fut: CommFuture, lanes: Iterable[Lane]) -> None:
        """Take ``fut`` out of ``lanes``' queues, and issue what it held back there."""
        for lane in lanes:
            try:
                lane.pending.remove(fut)
            except ValueError:
                continue
            self._pump(lane)

    def _run_work(self) -> None:
        """Settle the queued completions, and everything they release, iteratively."""
        work = self._work
        while work:
            fut, error = work.popleft()
            self._settle(fut, error)

    def _settle(self, fut: CommFuture, error: BaseException | None) -> None:
        """Finish ``fut``: run its finishing step, resolve it, release what depends on it."""
        state = fut._state
        if error is None and state == ISSUED and fut.finish is None:
            # The common case, kept short: every line here runs once per operation.
            fut.t_done = now = self._clock()
            if fut is self._unindexed:
                self._unindexed = None
            elif fut.reads or fut.writes:
                self._hazards.remove(fut, fut.reads, fut.writes, True)
            self._unfinished -= 1
            self._n_completed += 1
            fut._state = DONE
            lane = fut.lane
            lane.history.append((fut.kind, fut.seq, DONE, fut.nbytes, fut.t_submit,
                                 fut.t_issue, now, ""))
            if self.log is not None:
                self._log(fut, lane, now)
            if fut.stream is None:
                lane.issued -= 1
            if lane.pending:  # its place in the lane's window is free
                self._pump(lane)
            fut.hold = fut._request = fut._on_stream = None  # release buffers now
            callbacks = fut._callbacks
            fut._callbacks = None
            if callbacks:
                self._due.extend((cb, fut) for cb in callbacks)
            if fut._dependants:
                self._release(fut, None)
            return
        if state >= DONE:
            return
        if error is None and fut.finish is not None:
            try:
                fut.finish(fut)
            except MCRDLError as exc:  # the runtime's own verdict (e.g. DesyncError): as is
                error = exc
            except Exception as exc:
                error = BackendError(f"{fut.kind}#{fut.seq}: finishing step failed: {exc}")
                error.__cause__ = exc
        fut.t_done = now = self._clock()
        zombie = error is not None and fut in self._zombies
        if fut is self._unindexed:
            self._unindexed = None
            if zombie and (fut.reads or fut.writes):
                self._hazards.add(fut, fut.reads, fut.writes)
        elif (fut.reads or fut.writes) and not zombie:
            self._hazards.remove(fut, fut.reads, fut.writes, error is None)
        self._unfinished -= 1
        lane = fut.lane
        if state == ISSUED and fut.stream is None:
            lane.issued -= 1
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
            if self.on_desync is not None and isinstance(error, DesyncError):
                self._due.append((self.on_desync, fut))
            if zombie:  # its backend may still write the result: keep it with the rest
                fut.hold = (fut.hold, fut._result)
            fut._result = None
        lane.history.append((fut.kind, fut.seq, fut._state, fut.nbytes, fut.t_submit,
                             fut.t_issue, now, ""))
        if self.log is not None:
            self._log(fut, lane, now)
        fut.start = fut.args = fut.finish = None  # (an emulated AVG's holds its tensor)
        if not zombie:
            fut.hold = fut._request = None
        callbacks = fut._callbacks
        fut._callbacks = None
        if callbacks:
            self._due.extend((cb, fut) for cb in callbacks)
        if error is not None:
            if fut._dependants:  # queued first: their own error says more than a break
                self._release(fut, error)
            if fut._on_stream:
                self._fail_on_stream(fut, error)
            # Break before the lane moves on: issuing the operation behind this one first
            # would let the peers match it in this one's place (rule 7 of docs/design.md).
            if (lane.size > 1
                    and (state == PENDING or isinstance(error, _NOT_AS_ISSUED)
                         or fut.kind == AGREEMENT_KIND)
                    and not isinstance(error, _IN_STEP)):
                # Where this rank stops: at an operation that never reached the peers, or
                # never ran here and holds up the work behind it on an in-order lane (found
                # out after the break when a worker's start fails late).
                stops_here = (state == PENDING or isinstance(error, StartError)
                              or lane.in_order)
                if lane.comm.broken is None or stops_here:
                    why = (f"{fut.kind}#{fut.seq} on {lane.backend_name}: {error}"
                           if fut.kind == AGREEMENT_KIND and state == ISSUED else error)
                    self._break(lane.comm, f"on rank {lane.rank}, {why}",
                                fut if stops_here else None)
        if state == PENDING:
            route = fut._route
            if route is not None:
                fut._route = None
                if type(route) is tuple:
                    self._unroute(fut, route[0])
                else:
                    route.drop(fut)
            elif lane.pending and lane.pending[0] is fut:
                self._pump(lane)
        elif lane.pending:  # its place in the lane's window is free (after any break above)
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
        """Tell ``fut``'s dependants it finished: issue the ready ones, or fail them all."""
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

    def _fail_on_stream(self, fut: CommFuture, error: BaseException) -> None:
        """``fut`` failed after its dependants on the device went on behind it on their
        streams (`_enqueued`): they read or overwrite what it did not produce, so they fail
        too (given up and their communicator broken, if issued)."""
        dependants, fut._on_stream = fut._on_stream, None
        for dep in dependants:  # type: ignore[union-attr]
            if dep._state >= DONE or (dep._state == ISSUED and dep not in dep.lane.track):
                continue  # it ended, or was given up already (its settle is queued)
            failure = DependencyFailedError(
                f"{dep.kind}#{dep.seq} on {dep.lane.backend_name} waited on its stream for "
                f"{fut.kind}#{fut.seq}, which {STATE_NAMES[fut._state].lower()}: {error}")
            if dep._state == ISSUED:
                # Issued, it reaches its peers with what fut did not produce: it must not
                # run as they expect, so it breaks its communicator (rule 7), as a dependant
                # still pending would by failing.
                self._give_up(dep, failure)
                if dep.lane.size > 1:
                    self._break(dep.lane.comm, f"on rank {dep.lane.rank}, {failure}", dep)
            else:
                self._work.append((dep, failure))

    def _dep_done(self, dep: CommFuture) -> None:
        """One of ``dep``'s dependencies is met: issue (or route) it if it was the last."""
        dep._deps_left -= 1
        if dep._deps_left == 0 and dep._state == PENDING:
            if dep._route is not None:
                self._route(dep)
                return
            dlane = dep.lane
            if dlane.pending and dlane.pending[0] is dep:
                self._pump(dlane)

    # -- breaking a communicator (lock held) ---------------------------------------------

    def _break(self, comm: CommState, cause: str, culprit: CommFuture | None = None) -> None:
        """Break ``comm`` for ``cause``: stop issuing on it (``culprit``, if any, is an
        operation that will not run here as the peers expect), fail what was not issued,
        fail what a member that stopped will never match, and tell the peers where this
        rank stopped."""
        doomed = [] if culprit is None else [culprit, *self._behind(culprit)]
        if comm.broken is not None:
            if doomed:  # found out late (a worker's failed start): stop earlier
                self._stop_earlier(comm, doomed)
            return
        comm.broken = cause
        mine = comm.stops[comm.rank] = self._stops_of(comm, doomed)
        for lane in comm.lanes:
            for fut in lane.pending:
                if fut._state == PENDING:
                    self._work.append((fut, self._broken_error(fut)))
        if comm.names is not None:
            for fut in comm.names.held:
                self._work.append((fut, self._broken_error(fut)))
        self._apply_stops(comm)
        self._to_tell.append((comm, cause, mine))

    def _stop_earlier(self, comm: CommState, doomed: list[CommFuture]) -> None:
        """``doomed`` will not run here either, found out after this rank told its stops on
        the broken ``comm``: lower them, and tell again if they moved."""
        told = comm.stops[comm.rank]
        stops = self._stops_of(comm, doomed, told)
        if stops != told:
            comm.stops[comm.rank] = stops
            self._apply_stops(comm)
            self._to_tell.append((comm, comm.broken or "", stops))

    def _heard(self, comm: CommState, cause: str, peer: int, stops: Stops) -> None:
        """Member ``peer`` of ``comm`` stopped at ``stops``: break here too (for its cause,
        if this is the first news), and fail what it will never match."""
        comm.stops[peer] = stops
        if comm.broken is None:
            self._break(comm, cause)
        else:
            self._apply_stops(comm)

    def _stops_of(self, comm: CommState, doomed: list[CommFuture],
                  told: Stops | None = None) -> Stops:
        """Where this rank stops on ``comm``: per lane, the first position it did not issue,
        or that is ``doomed`` (issued, but it will not run here); never past ``told``, the
        stops it told already."""
        stops: Stops = {}
        for lane in comm.lanes:
            base = told.get(lane.key) if told is not None else None
            if base is None:
                first = lane.submitted + 1
                streams = {key: n + 1 for key, n in lane.streams.items()}
            else:
                first, streams = base[0], dict(base[1])
            unissued = [f for f in lane.pending if f._state == PENDING]
            unissued.extend(doomed)
            for fut in unissued:
                route = fut._route
                if route is not None:  # its place here, routed here or not (a named
                    # operation not yet agreed on has none)
                    if type(route) is tuple and lane in route[2]:
                        first = min(first, route[2][lane])
                elif fut.lane is lane:
                    if fut.stream is None:
                        first = min(first, fut.index)
                    else:
                        streams[fut.stream] = min(streams.get(fut.stream, fut.index),
                                                  fut.index)
            stops[lane.key] = (first, streams)
        return stops

    @staticmethod
    def _behind(fut: CommFuture) -> list[CommFuture]:
        """What ``fut``'s lane issued after it and still runs: if the lane runs its work in
        order (a stream, a worker thread), none of it runs unless ``fut`` does."""
        lane = fut.lane
        if not lane.in_order or fut._route is not None:  # (not placed: nothing is behind)
            return []
        if lane.named:  # placed in the agreed order, not in submission order
            return [f for f, _ in lane.track.items() if f.lane is lane and f.index > fut.index]
        return [f for f, _ in lane.track.items() if f.lane is lane and f.seq > fut.seq]

    def _apply_stops(self, comm: CommState) -> None:
        """Give up the operations in flight on ``comm`` that a member that stopped will never
        match; the others run on (every member issued them). On an in-order lane, what waits
        behind one given up never runs either: this rank stops there too, and says so."""
        known = comm.stops
        gone = dict.fromkeys(f for track in self._track_list for f, _ in track.items()
                             if f.lane.comm is comm and _unmatched(f, known))
        wedged = [b for f in gone for b in self._behind(f) if b not in gone]
        for fut in gone:
            self._give_up(fut, self._broken_error(fut))
        if wedged:
            self._stop_earlier(comm, wedged)

    @staticmethod
    def _broken_error(fut: CommFuture) -> CommBrokenError:
        comm = fut.lane.comm
        return CommBrokenError(
            f"{fut.kind}#{fut.seq} on lane {fut.lane.backend_name}:{fut.lane.comm_name}: "
            f"communicator {comm.name} is broken ({comm.broken}); nothing more runs on it"
        )

    def _give_up(self, fut: CommFuture, error: BaseException) -> None:
        """Fail the issued ``fut`` the engine will not wait for any longer; a zombie if its
        backend cannot cancel it."""
        track = fut.lane.track
        request = track.remove(fut)
        if not track.backend.cancel(request):
            self._zombies[fut] = None
        self._work.append((fut, error))

    def _zombie_done(self, fut: CommFuture) -> bool:
        """Test a zombie's request; bury it (forget its ranges and memory) if it finished."""
        try:
            done = bool(fut.lane.backend.test([fut._request]))
        except Exception:  # noqa: BLE001 - a failure is an end too
            done = True
        if done:
            del self._zombies[fut]
            if fut.reads or fut.writes:
                self._hazards.remove(fut, fut.reads, fut.writes, True)
            fut.hold = fut._request = None
        return done

    # -- after the lock ------------------------------------------------------------------

    def _after_lock(self) -> None:
        """What an entry point does once it released the lock, where anything became due:
        run the callbacks, tell peers of breaks."""
        if self._due:
            self._flush_due()
        if self._to_tell:
            self._tell()

    def _flush_due(self) -> None:
        with self._lock:  # appended under it: swapping under it loses none
            due, self._due = self._due, []
        for cb, fut in due:
            try:
                cb(fut)
            except Exception:  # noqa: BLE001 - a callback's failure is reported, not ours
                report_callback_error(cb, fut)

    def _tell(self) -> None:
        with self._lock:
            to_tell, self._to_tell = self._to_tell, []
        if self.on_break is not None:
            for comm, cause, stops in to_tell:
                self.on_break(comm, cause, stops)

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
            if self._deferred:
                self._post_deferred()
            if self._gated and self._open_gates():
                progressed = True
            for track in self._track_list:
                if not track.live:
                    continue
                finished = track.poll()
                if not finished:
                    continue
                progressed = True
                self._work.extend(finished)
                self._run_work()
        finally:
            lock.release()
        if self._due or self._to_tell:
            self._after_lock()
        return progressed

    def spin_lone(self, fut: CommFuture) -> bool:
        """``poll_once`` while ``fut``'s request is the only one in flight, ``lone_spins``
        times.

        Then every track but ``fut``'s is empty and ``fut``'s holds its request alone, so one
        poll is one test of that request: this tests it directly (the backend's ``test_one``),
        without walking the tracks, and settles it as ``poll_once`` would. Other operations
        may be unfinished, but none is in flight: they wait to be issued behind ``fut`` (a
        burst on MPI's one-collective window), or for their dependencies, which only ``fut``'s
        settle or a new submission can move (no named round is due and no device event is
        awaited; rule 5 holds: there is nothing else to poll). Only where spinning
        is safe: not for a self-progressing backend (its threads need the CPU), not on an
        oversubscribed node, not in a simulated world (its ranks progress only in the idle
        hook). Returns True once ``fut`` is done; False at once where it may not spin, after
        ``lone_spins`` tests, or as soon as another operation arrives or another thread holds
        the lock (the caller then polls the general way). A test costs ~0.2 µs where a poll
        of every track costs ~0.7, which is most of a small MPI operation's wait (and half of
        a 64 KiB one's in a burst, docs/performance.md).
        """
        carrier = fut.carrier
        if carrier is not None:  # in flight as part of its carrier: spin on the carrier's
            return self.spin_lone(carrier) and fut._state >= DONE
        lane = fut.lane
        track = lane.track
        if (fut._state != ISSUED or not lane.spins_alone or track.live != 1
                or self.idle_hook is not None or self._deferred or self._gated):
            return False
        unfinished = self._unfinished
        if unfinished != 1:  # the others are all waiting to be issued?
            for other in self._track_list:
                if other.live and other is not track:
                    return False
        lock = self._lock
        test = track.backend.test_one
        request = fut._request
        rest = _REST_OF_BURST
        # Counted as a driver meanwhile, so that the background thread keeps off: a test of a
        # large message moves a chunk of it, and the spin can last the whole operation; the
        # thread, polling MPI every background_min beside it, slowed large operations by a
        # quarter (docs/performance.md).
        self.drivers += 1
        try:
            for _ in self._lone_bursts:  # none on an oversubscribed node
                if not lock.acquire(False):
                    return False
                try:
                    if self._unfinished != unfinished or fut._state != ISSUED:
                        return fut._state >= DONE
                    self._n_polls += _BURST
                    # A burst of tests under one hold of the lock: nothing can change
                    # meanwhile. The first test stands alone: it is the one that finds most
                    # small operations done, and a loop costs more than the test
                    # (docs/performance.md).
                    error: BaseException | None = None
                    try:
                        if not test(request):
                            for _ in rest:
                                if test(request):
                                    break
                            else:
                                continue  # not finished: release the lock (finally), go on
                    except BackendError as exc:
                        error = exc
                    except Exception as exc:  # noqa: BLE001 - a backend's failure fails it
                        error = BackendError(
                            f"{fut.kind}#{fut.seq} on {lane.backend_name}: {exc}")
                        error.__cause__ = exc
                    track.empty()  # fut's request was its only live entry
                    self._settle(fut, error)
                    self.last_active = fut.t_done
                    if self._work:
                        self._run_work()
                finally:
                    lock.release()
                if self._due or self._to_tell:
                    self._after_lock()
                return True
            return False
        finally:
            self.drivers -= 1

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
            thread.wanted = True  # (before reading parked: a park starting now sees it)
            if thread.parked:
                thread.wake()

    # -- signals, deadlines, breaks told by peers ----------------------------------------

    def request_abort(self, reason: str) -> None:
        """Fail every unfinished operation with CommAbortedError at the next check.

        Safe from a signal handler: it only sets a flag (the handler may interrupt a thread
        that holds the engine's lock).
        """
        self._abort_reason = reason

    def post_break(self, comm_name: str, cause: str, peer: int, stops: Stops) -> None:
        """Member ``peer`` of ``comm_name`` stopped issuing there at ``stops``, the
        communicator broken for ``cause``: apply it at the next check.

        Safe from any thread, and from a signal handler (it only appends to a deque).
        """
        self._told.append((comm_name, cause, peer, stops))

    def check_signals(self) -> None:
        """Apply what arrived from outside since the last check: an abort, breaks that peers
        told of. Cheap when nothing did (two reads)."""
        if self._abort_reason is not None:
            reason, self._abort_reason = self._abort_reason, None
            self.fail_all(lambda f: CommAbortedError(f"{f.kind}#{f.seq} on lane "
                                                     f"{f.lane.backend_name}:{f.lane.comm_name}"
                                                     f" aborted: {reason}"))
        if self._told:
            with self._lock:
                while self._told:
                    name, cause, peer, stops = self._told.popleft()
                    comm = self._comms.get(name)
                    if comm is not None:
                        self._heard(comm, cause, peer, stops)
                    else:
                        self._told_early.setdefault(name, []).append((cause, peer, stops))
                self._run_work()
            self._after_lock()

    def check_deadlines(self, now: float) -> None:
        """Apply outside signals (``check_signals``); then, at most every ``timeout / 8``
        (0.25 s at most), fail issued operations older than ``timeout`` with
        CommTimeoutError, and named operations that waited for agreement that long with
        DesyncError, and bury zombies whose backend has finished with
        them."""
        self.check_signals()
        if now < self._next_check:
            return
        timeout = self.timeout
        self._next_check = now + (0.25 if timeout is None else min(timeout / 8, 0.25))
        with self._lock:
            for zombie in list(self._zombies):
                self._zombie_done(zombie)
            if timeout is None:
                return
            limit = now - timeout
            named: dict[Names, list[CommFuture]] = {}
            for comm in self._comms.values():
                if comm.names is not None and comm.broken is None:
                    futs = comm.names.expired(limit)
                    if futs:
                        named[comm.names] = futs
            expired = [f for t in self._track_list for f, _ in t.items() if f.t_issue < limit]
            if not expired and not named:
                return
            timed_out = _with_carried(expired)  # (what they carry times out with them)
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
                why = (fut.lane.backend.describe_wait(fut._request)
                       or "the peers it needs have not all arrived")
                self._give_up(fut, CommTimeoutError(
                    f"{fut.kind}#{fut.seq} on lane {fut.lane.backend_name}:{fut.lane.comm_name} "
                    f"(rank {fut.lane.rank} of {fut.lane.size}) did not finish within "
                    f"{timeout:g} s of being issued; {why}"
                ))
            self._run_work()
        self._after_lock()
        if report is not None:
            report()

    # -- operations the engine makes, and named operations' places (lock held) ----------

    def add_own(self, fut: CommFuture) -> None:
        """Submit ``fut``, an operation the engine makes itself (a `Names` agreement round),
        at the end of its lane; lock held. It has no ranges and no dependencies."""
        fut._engine = self
        fut.t_submit = self._clock()
        lane = fut.lane
        lane.submitted = fut.index = lane.submitted + 1
        self._unfinished += 1
        lane.pending.append(fut)
        self._pump(lane)

    def defer(self, names: Names) -> None:
        """Let ``names`` post its next round at ``names.later`` (checked by every poll);
        lock held."""
        self._deferred[names] = None

    def _post_deferred(self) -> None:
        now = self._clock()
        for names in list(self._deferred):
            if names.later is None:
                del self._deferred[names]
            elif now >= names.later:
                del self._deferred[names]
                names.due(now)
        self._run_work()

    def place(self, futs: list[CommFuture]) -> None:
        """Give the named operations ``futs`` (agreed on, in the agreed order) their places
        at the end of their lanes, and issue them; lock held."""
        lanes: dict[Lane, None] = {}
        for fut in futs:
            fut._route = None
            if fut._state != PENDING:
                continue
            lane = fut.lane
            lane.submitted = fut.index = lane.submitted + 1
            lane.pending.append(fut)
            lanes[lane] = None
        for lane in lanes:
            self._pump(lane)

    # -- cancellation --------------------------------------------------------------------

    def cancel(self, fut: CommFuture) -> bool:
        """See `CommFuture.cancel`."""
        with self._lock:
            state = fut._state
            if state >= DONE:
                return False
            if state == ISSUED:
                backend = fut.lane.backend
                if fut.carrier is not None:
                    raise InvalidStateError(
                        f"cannot cancel {fut!r}: it was issued already, fused into "
                        f"{fut.carrier.kind}#{fut.carrier.seq}")
                if not backend.capabilities.cancel or not backend.cancel(fut._request):
                    raise InvalidStateError(
                        f"cannot cancel {fut!r}: it was issued already and "
                        f"{backend.name} cannot cancel issued operations"
                    )
                fut.lane.track.remove(fut)
            self._work.append((fut, FutureCancelledError(
                f"{fut.kind}#{fut.seq} on lane {fut.lane.backend_name}:{fut.lane.comm_name} "
                f"was cancelled")))
            self._run_work()
        self._after_lock()
        return True

    # -- shutdown ------------------------------------------------------------------------

    def fail_all(self, make_error: Callable[[CommFuture], BaseException]) -> int:
        """Fail every unfinished future with ``make_error(fut)``; returns how many."""
        with self._lock:
            issued = [f for track in self._track_list for f, _ in track.items()]
            failing = _with_carried(issued)  # (what they carry fails with them)
            for fut in issued:
                self._give_up(fut, make_error(fut))
            pending: dict[CommFuture, None] = {}
            for lane in self._lanes.values():
                pending.update((f, None) for f in lane.pending if f._state == PENDING)
            pending.update(self._held())
            for fut in pending:
                self._work.append((fut, make_error(fut)))
            self._run_work()
        self._after_lock()
        return len(failing) + len(pending)

    def zombies(self) -> list[CommFuture]:
        """The failed operations whose backend may still use their memory."""
        with self._lock:
            return list(self._zombies)

    def close(self, why: str) -> None:
        """Refuse further submissions and stop the background thread; idempotent.

        Zombies still unfinished keep their requests and memory for the rest of the process.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closed_why = why
            limit = time.monotonic() + (self.timeout if self.timeout is not None else 300.0)
            _ABANDONED.extend((fut, limit) for fut in self._zombies)
            self._zombies.clear()
            for comm in self._comms.values():
                if comm.broken is not None:
                    _WAITED_BY.update(_waited_by(comm))
        if self._thread is not None:
            self._thread.stop()

    @property
    def closed(self) -> bool:
        """True once ``close`` ran."""
        return self._closed

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters."""
        with self._lock:
            in_flight = len(self.issued_locked())
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
                zombies=len(self._zombies),
            )

    def unfinished(self) -> list[CommFuture]:
        """Every unfinished future: issued ones by backend, then pending ones by lane, then
        named ones not yet agreed on."""
        with self._lock:
            return self.unfinished_locked()

    def unfinished_locked(self) -> list[CommFuture]:
        """``unfinished()`` for a caller that holds the lock."""
        out = self.issued_locked()
        seen: dict[CommFuture, None] = {}
        for lane in self._lanes.values():
            seen.update((f, None) for f in lane.pending if f._state == PENDING)
        seen.update(self._held())
        out.extend(seen)
        return out

    def _held(self) -> dict[CommFuture, None]:
        """The named operations waiting for their members' agreement."""
        return {f: None for comm in self._comms.values() if comm.names is not None
                for f in comm.names.held}
