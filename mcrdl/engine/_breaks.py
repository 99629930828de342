"""Ranks stay in step (rule 7 of docs/design.md): breaking communicators, and zombies.

Peers match every operation on a communicator by its position. An operation that will not run
as issued on one member -- it ends unissued (cancelled, a dependency failed, its start failed)
or the engine gives up on it while issued (timed out, finalized) -- would leave the peers
matching different operations from then on: wrong data, and no error. The communicator
*breaks* instead, on every member (`CommState` says how precisely: only what some member
will never issue fails). This member stops issuing there and tells its peers where (its
*stops*, through the runtime's notices); what they tell arrives through ``post_break``.

Issued operations the engine gives up on while their backend cannot cancel them become
*zombies*: their future fails, but their request, the memory they use and their byte ranges
stay with the engine until the backend reports them finished (MPI collectives cannot be
cancelled, and may still write their output). A new operation on such bytes fails at once
instead of racing the backend's late writes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core._errors import (
    BackendError,
    CommBrokenError,
    CommTimeoutError,
    DesyncError,
    FutureCancelledError,
    InvalidStateError,
    PeerLostError,
    RuntimeFinalizedError,
    StartError,
)
from ..core._forever import forever
from ._states import AGREEMENT_KIND, DONE, ISSUED, PENDING
from ._lanes import ANY_PEER
from ._tracks import with_carried

if TYPE_CHECKING:
    import threading

    from ._future import CommFuture
    from ._hazards import HazardIndex
    from ._lanes import CommState, Lane, Stops
    from ._tracks import Track

__all__ = ["Breaks", "linger", "waited_by"]

#: Errors that mean an issued operation will not run as its peers expect, so that it breaks
#: its communicator like an operation that was never issued: the engine gave up on it
#: (timed out, finalized, cancelled), or it never started (a backend's worker
#: thread could not start it). Any other error a backend reports is the operation's own.
_NOT_AS_ISSUED = (CommTimeoutError, RuntimeFinalizedError, FutureCancelledError, StartError)

#: Errors that end an unissued operation without breaking its communicator: it is broken
#: already, or debug mode refused the operation, which every member does alike (they all
#: read the same fingerprints), so the members stay in step.
_IN_STEP = (CommBrokenError, DesyncError)

#: Zombies left unfinished when their engine closed, with the monotonic time by which their
#: backend gives up on them: their requests and the memory their backends may still use are
#: kept for the rest of the process, past the interpreter's teardown (`forever`: MPI_Finalize
#: runs after it, and may still move their bytes).
_ABANDONED: list[tuple[CommFuture, float]] = forever([])
#: World ranks of the peers that, when an engine closed, had a send or receive toward this
#: rank that this rank never matched, on a backend that holds a thread for it (`linger`).
_WAITED_BY: set[int] = set()


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
        if fut.stream is not None and fut.stream[0] != ANY_PEER:
            peer = comm.members[fut.stream[0]]
            if peer < comm.members[comm.rank] and peer in _WAITED_BY:
                continue
        waits.append((limit, event))
    if waits:
        before()
    for limit, event in waits:
        event.wait(max(0.0, limit - time.monotonic()))


def waited_by(comm: CommState) -> list[int]:
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


def _unmatched(fut: CommFuture, known: dict[int, Stops]) -> bool:
    """Whether a member whose stops are ``known`` will never match ``fut``: a collective at or
    past any member's stop on its lane; a send or receive at or past its peer's stop on the
    matching stream (the peer's receives from here, or sends to here, with that tag); a
    receive from any source not yet matched, once any peer stopped (it cannot tell which of
    them would have sent its message)."""
    key = fut.lane.key
    if fut.stream is not None and fut.stream[0] == ANY_PEER:
        return any(peer != fut.lane.rank for peer in known)
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


class Breaks:
    """The engine's rule 7 (a part of `Engine`; lock held unless a method says otherwise)."""

    if not TYPE_CHECKING:  # (the engine declares the slots: it has no __dict__)
        __slots__ = ()

    _comms: dict[str, CommState]
    _lanes: dict[tuple[str, str], Lane]
    _told: deque[tuple[str, str, int, Stops]]
    _lost: deque[tuple[int, str]]
    gone: dict[int, str]
    _told_early: dict[str, list[tuple[str, int, Stops]]]
    _to_tell: list[tuple[CommState, str, Stops]]
    _track_list: list[Track]
    _work: deque[tuple[CommFuture, BaseException | None]]
    _zombies: dict[CommFuture, None]
    _hazards: HazardIndex
    _lock: threading.Lock
    timeout: float | None
    on_heard: Callable[[CommState, str, int], Callable[[], None] | None] | None

    def _failed(self, fut: CommFuture, error: BaseException, state: int) -> None:
        """``fut`` (which was in ``state``) failed with ``error``: its dependants fail, and,
        if it will not run here as its peers expect, its communicator breaks -- before its
        lane moves on: issuing the operation behind it first would let the peers match that
        one in its place."""
        if fut._dependants:  # queued first: their own error says more than a break
            self._release(fut, error)
        if fut._on_stream:
            self._fail_on_stream(fut, error)
        lane = fut.lane
        if (lane.size > 1
                and (state == PENDING or isinstance(error, _NOT_AS_ISSUED)
                     or fut.kind == AGREEMENT_KIND)
                and not isinstance(error, _IN_STEP)):
            # Where this rank stops: at an operation that never reached the peers, or never
            # ran here and holds up the work behind it on an in-order lane (found out after
            # the break when a worker's start fails late).
            stops_here = state == PENDING or isinstance(error, StartError) or lane.in_order
            if lane.comm.broken is None or stops_here:
                why = (f"{fut.kind}#{fut.seq} on {lane.backend_name}: {error}"
                       if fut.kind == AGREEMENT_KIND and state == ISSUED else error)
                self._break(lane.comm, f"on rank {lane.rank}, {why}",
                            fut if stops_here else None)

    def fail_and_break(self, failures: list[tuple[CommFuture, BaseException]],
                       comm: CommState, cause: str) -> None:
        """Fail each of ``failures``' operations with its error, and break ``comm`` for
        ``cause`` at the first of them (the members no longer agree on what runs next)."""
        self._work.extend(failures)
        self._break(comm, cause, failures[0][0])

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
                placement = fut._placement
                if placement is not None:  # its place here, if it holds one meanwhile
                    held = placement.position(fut, lane)
                    if held is not None:
                        first = min(first, held)
                elif fut.lane is lane:
                    if fut.stream is None:
                        first = min(first, fut.index)
                    elif fut.stream[0] == ANY_PEER:
                        # It holds no position: every peer's stream of its tag toward this
                        # rank already stops at the first position not taken.
                        continue
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
        if not lane.in_order or fut._placement is not None:  # (not placed: nothing behind)
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
        return (PeerLostError if comm.lost else CommBrokenError)(
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

    def _bury(self, fut: CommFuture) -> bool:
        """Test a zombie's request; bury it (forget its ranges and memory) if it finished."""
        try:
            done = bool(fut.lane.backend.test([fut._request]))
        except Exception:  # noqa: BLE001 - a failure is an end too
            done = True
        if done:
            del self._zombies[fut]
            if fut.reads or fut.writes:
                self._hazards.remove(fut, True)
            fut.hold = fut._request = None
        return done

    # -- operations ended from outside ----------------------------------------------------

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

    def fail_all(self, make_error: Callable[[CommFuture], BaseException]) -> int:
        """Fail every unfinished future with ``make_error(fut)``; returns how many."""
        with self._lock:
            issued = [f for track in self._track_list for f, _ in track.items()]
            failing = with_carried(issued)  # (what they carry fails with them)
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

    def _abandon(self) -> None:
        """The engine closes: its zombies keep their requests and memory for the rest of the
        process (`linger`), and the peers that wait for this rank are noted."""
        limit = time.monotonic() + (self.timeout if self.timeout is not None else 300.0)
        _ABANDONED.extend((fut, limit) for fut in self._zombies)
        self._zombies.clear()
        for comm in self._comms.values():
            if comm.broken is not None:
                _WAITED_BY.update(waited_by(comm))

    # -- what arrives from outside (any thread, or a signal handler) ---------------------

    def post_break(self, comm_name: str, cause: str, peer: int, stops: Stops) -> None:
        """Member ``peer`` of ``comm_name`` stopped issuing there at ``stops``, the
        communicator broken for ``cause``: apply it at the next check.

        Safe from any thread, and from a signal handler (it only appends to a deque).
        """
        self._told.append((comm_name, cause, peer, stops))

    def post_lost(self, world_rank: int, cause: str) -> None:
        """The process of world rank ``world_rank`` is gone (``cause`` says how): every
        communicator it is a member of breaks at the next check, as if it had stopped before
        its first operation there, since it will match nothing more. Communicators without
        it go on.

        Safe from any thread (it only appends to a deque)."""
        self._lost.append((world_rank, cause))

    def learn_lost(self, world_rank: int, cause: str) -> None:
        """`post_lost`, applied at once (`check_signals`): from any thread but a signal
        handler, without the lock (the notices' and the mesh's threads)."""
        self.post_lost(world_rank, cause)
        self.check_signals()

    def _as_lost(self, fut: CommFuture, error: BackendError) -> BaseException:
        """``fut``'s backend ``error``, as PeerLostError where a member of its communicator
        is gone, what arrived of deaths applied first: the death is why it failed, and the
        communicator breaks for it (here, and at the peers it tells)."""
        if self._lost:
            self._apply_lost()
        comm = fut.lane.comm
        if not comm.lost:
            return error
        lost = PeerLostError(
            f"{fut.kind}#{fut.seq} on lane {fut.lane.backend_name}:{fut.lane.comm_name}: "
            f"communicator {comm.name} is broken ({comm.broken}); its backend said: {error}")
        lost.__cause__ = error
        return lost

    def _apply_lost(self) -> None:
        """Break the communicators of the members the launcher or the mesh told are gone
        (lock held)."""
        while self._lost:
            gone, cause = self._lost.popleft()
            self.gone.setdefault(gone, cause)
            for comm in list(self._comms.values()):
                self._break_for_gone(comm)

    def _break_for_gone(self, comm: CommState) -> None:
        """Break ``comm`` for each of its members that is gone and that it has not yet
        broken for (lock held)."""
        for rank in comm.members:
            if rank in self.gone and rank not in comm.lost:
                comm.lost.add(rank)
                # Its stops: none on any lane, so nothing of it is matched from here.
                self._heard(comm, f"rank {rank} is gone: {self.gone[rank]}",
                            comm.members.index(rank), {})

    def check_signals(self) -> None:
        """Apply what arrived from outside since the last check: breaks that peers told of,
        processes the launcher or the mesh told are gone. Cheap when nothing did (two
        reads). Without the lock."""
        if self._lost:
            with self._lock:
                self._apply_lost()
                self._run_work()
            self._after_lock()
        if self._told:
            reports = []
            with self._lock:
                while self._told:
                    name, cause, peer, stops = self._told.popleft()
                    comm = self._comms.get(name)
                    if comm is not None:
                        if comm.broken is None and self.on_heard is not None:
                            reports.append(self.on_heard(comm, cause, peer))
                        self._heard(comm, cause, peer, stops)
                    else:
                        self._told_early.setdefault(name, []).append((cause, peer, stops))
                self._run_work()
            self._after_lock()
            for report in reports:
                if report is not None:
                    report()

    if TYPE_CHECKING:  # the engine's other parts
        def _held(self) -> dict[CommFuture, None]: ...
        def _release(self, fut: CommFuture, error: BaseException | None) -> None: ...
        def _fail_on_stream(self, fut: CommFuture, error: BaseException) -> None: ...
        def _run_work(self) -> None: ...
        def _after_lock(self) -> None: ...
        def fail_all(self, make_error: Callable[[CommFuture], BaseException]) -> int: ...
