"""Where operations are: communicators and their lanes, places decided late, what is where.

An operation's place is a lane and a position there (`Lane.take`), the same on every member:
its peers match it by that place. Most operations get theirs at submission. Two kinds get it
once their dependencies have finished: a routed one (`Route`), whose lane is chosen by what a
dependency produced, and a named one, whose members agree on its place (`Names`); both are
`Placement`s, and ``place`` gives them their positions.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core._errors import BackendError, MCRDLError
from ._lanes import CommState, Lane, Stops
from ._states import PENDING
from ._tracks import Track, with_carried

if TYPE_CHECKING:
    from ..backends import Backend
    from ._core import Engine
    from ._future import CommFuture
    from ._names import Names

__all__ = ["EngineStats", "Places", "Route"]


@dataclass(frozen=True)
class EngineStats:
    """Counters of one engine since it started.

    Attributes:
        submitted, issued, completed, failed, cancelled: operations by what happened to them.
        pending: submitted, not yet issued (waiting for dependencies or their lane).
        in_flight: issued, not yet finished.
        polls: calls of ``poll`` that ran (took the lock).
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


class Route:
    """The placement of an operation whose lane is chosen once its dependencies have
    finished (an alltoallv routed by the total its exchange agrees on, `mcrdl.front`).

    Meanwhile it holds a position, and the head of the queue, in every candidate lane (all of
    one communicator), so that whichever it goes to, every member issues it at the same
    position there (rule 2), and nothing submitted after it on any of them overtakes it.
    """

    gathers = False
    __slots__ = ("engine", "lanes", "choose", "reserved")

    def __init__(self, engine: Engine, fut: CommFuture, lanes: tuple[Lane, ...],
                 choose: Callable[[CommFuture], None]) -> None:
        self.engine = engine
        self.lanes = lanes
        #: Sets ``fut.lane``, ``fut.start`` and ``fut.args`` (``fut.lane`` is a placeholder
        #: among the candidates until then).
        self.choose = choose
        self.reserved = {lane: lane.take(None) for lane in lanes}
        for lane in lanes:
            lane.pending.append(fut)

    def ready(self, fut: CommFuture) -> None:
        self.engine._routed(fut, self)

    def drop(self, fut: CommFuture) -> None:
        self.engine._unroute(fut, self.lanes)

    def position(self, fut: CommFuture, lane: Lane) -> int | None:
        return self.reserved.get(lane)


class Places:
    """The engine's communicators, lanes and places (a part of `Engine`)."""

    if not TYPE_CHECKING:  # (the engine declares the slots: it has no __dict__)
        __slots__ = ()
    _lock: threading.Lock
    _comms: dict[str, CommState]
    _lanes: dict[tuple[str, str], Lane]
    _tracks: dict[Backend, Track]
    _track_list: list[Track]
    _told_early: dict[str, list[tuple[str, int, Stops]]]
    gone: dict[int, str]
    _work: deque[tuple[CommFuture, BaseException | None]]
    _deferred: dict[Names, None]
    _zombies: dict[CommFuture, None]
    _clock: Callable[[], float]
    _unfinished: int
    _n_completed: int
    _n_failed: int
    _n_cancelled: int
    _n_dropped: int
    _n_polls: int

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
                    if self.gone:
                        self._break_for_gone(state)  # a member was gone before it was made
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
                    track = self._tracks.get(backend)
                    if track is None:
                        track = self._tracks[backend] = Track(backend)
                        self._track_list.append(track)
                    lane = self._lanes[key] = Lane(backend, group, comm, name, track, named)
                    comm.lanes.append(lane)
        return lane

    def lanes(self) -> list[Lane]:
        """Every lane, in creation order."""
        return list(self._lanes.values())

    def agreements(self) -> list[Names]:
        """The named-operation agreements of the communicators that have them."""
        return [comm.names for comm in self._comms.values() if comm.names is not None]

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

    # -- placement (lock held) -----------------------------------------------------------

    def _routed(self, fut: CommFuture, route: Route) -> None:
        """``fut``'s dependencies are met: choose its lane, and let the other candidates go
        on."""
        try:
            route.choose(fut)
        except Exception as exc:  # noqa: BLE001 - fails the operation, not the engine
            err = exc if isinstance(exc, MCRDLError) else BackendError(
                f"{fut.kind}#{fut.seq}: choosing its backend failed: {exc}")
            if err is not exc:
                err.__cause__ = exc
            self._work.append((fut, err))  # (its settle takes it out of the lanes)
            return
        fut._placement = None
        fut.index = route.reserved[fut.lane]
        self._unroute(fut, [lane for lane in route.lanes if lane is not fut.lane])
        self._pump(fut.lane)

    def _unroute(self, fut: CommFuture, lanes: Iterable[Lane]) -> None:
        """Take ``fut`` out of ``lanes``' queues, and issue what it held back there."""
        for lane in lanes:
            try:
                lane.pending.remove(fut)
            except ValueError:
                continue
            self._pump(lane)

    def place(self, futs: list[CommFuture]) -> None:
        """Give the named operations ``futs`` (agreed on, in the agreed order) their places
        at the end of their lanes, and issue what may be; lock held."""
        lanes: dict[Lane, None] = {}
        for fut in futs:
            fut._placement = None
            if fut._state != PENDING:
                continue
            lane = fut.lane
            fut.index = lane.take(None)
            lane.pending.append(fut)
            lanes[lane] = None
        for lane in lanes:
            self._pump(lane)

    def defer(self, names: Names) -> None:
        """Let ``names`` post its next round at ``names.later`` (checked by every poll);
        lock held."""
        self._deferred[names] = None

    # -- what others read ----------------------------------------------------------------

    def in_flight(self) -> int:
        """Operations submitted and not yet finished (issued or not)."""
        return self._unfinished

    def zombies(self) -> list[CommFuture]:
        """The failed operations whose backend may still use their memory."""
        with self._lock:
            return list(self._zombies)

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

    def issued_locked(self) -> list[CommFuture]:
        """The issued, unfinished futures (the caller holds the lock): each track's, and what
        their carriers carry."""
        return with_carried([f for t in self._track_list for f, _ in t.items()])

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
        return {f: None for names in self.agreements() for f in names.held}

    if TYPE_CHECKING:  # the engine's other parts
        def _heard(self, comm: CommState, cause: str, peer: int, stops: Stops) -> None: ...
        def _break_for_gone(self, comm: CommState) -> None: ...
        def _pump(self, lane: Lane) -> None: ...
