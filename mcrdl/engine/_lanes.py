"""Lanes: one ordered issue queue per (backend, communicator), and the communicators they serve."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from ._states import STATE_NAMES

if TYPE_CHECKING:
    from ..backends import Backend
    from ._future import CommFuture
    from ._names import Names
    from ._tracks import Track

__all__ = ["ANY_PEER", "CommState", "Lane", "OpRecord", "Stops", "take_source"]

#: The peer of a receive from any source, in its stream ``(peer, tag, sends)`` until a message
#: matches it: it takes its position then, on the stream of the peer that sent it.
ANY_PEER = -1

#: Where a member stopped issuing on a broken communicator: per lane (by its ``key``), the
#: index of the first collective it did not issue, and per stream ``(peer, tag, sends)`` the
#: index of the first operation of that stream it did not issue (a stream it never used:
#: absent, meaning 1). Plain data: it travels between ranks.
Stops = dict[str, tuple[int, dict[tuple[int, int, bool], int]]]

#: How many finished operations each lane remembers for the flight recorder.
HISTORY = 64


class OpRecord(NamedTuple):
    """A finished operation as the flight recorder keeps it (no buffers: nothing kept alive)."""

    kind: str
    seq: int
    state: str
    nbytes: int
    t_submit: float
    t_issue: float
    t_done: float
    detail: str


class CommState:
    """The engine's view of one communicator: its lanes, its members, and whether it broke.

    Peers match every operation on a communicator by its position (MPI and NCCL order
    collectives by call order; sends and receives by order per peer and tag). So an operation
    that will not run as issued on one member -- it ends unissued (cancelled, a dependency
    failed, its start failed) or the engine gives up on it while issued (timed out, finalized)
    -- would leave the peers matching different operations from then on: wrong data, and no
    error. The communicator *breaks* instead, on every member: its unfinished and later
    operations fail with CommBrokenError naming the first cause, and nothing is issued on it
    again (docs/design.md rule 7; ``Engine`` applies it, the runtime's notices tell the peers).
    A failure the backend reports for an issued operation (a truncated receive) is that
    operation's own: its peers matched it, and the communicator stays in step.

    Precisely: only what some member will never issue fails. Every operation has an
    ``index``, its position among the lane's collectives (or among its stream's sends or
    receives), the same on every member. A member that breaks the communicator, or hears of
    its breaking, stops issuing on it and publishes its *stops*: per lane, the index of the
    first collective it did not issue, and per stream the same. An operation it issued
    before stopping still runs, and finishes wherever every member issued it (a ``split``'s
    allgather that completed on the other members must not fail here); one at or past a
    member's stop fails, since that member will never match it.

    Invariants:
    - ``lanes`` are every lane of the communicator, its debug lane included.
    - ``broken`` is None, or the first cause, and never changes back.
    - ``members`` are the world ranks of its members, in its rank order (whom to tell).
    - ``stops`` maps a member's rank here to its stops (`Stops`), once it has stopped.
    - ``names`` matches its named operations across its members (`Names`; None where the
      communicator has no named lanes).
    - ``lost`` holds the world ranks of members whose process is gone (the launcher told);
      a member there counts as stopped before its first operation on every lane, and the
      communicator's errors are `PeerLostError`.
    """

    __slots__ = ("name", "rank", "size", "members", "lanes", "broken", "stops", "names",
                 "lost")

    def __init__(self, name: str, rank: int, size: int, members: tuple[int, ...]) -> None:
        self.name = name
        self.rank = rank
        self.size = size
        self.members = members
        self.lanes: list[Lane] = []
        self.broken: str | None = None
        self.stops: dict[int, Stops] = {}
        self.names: Names | None = None
        #: World ranks of members whose process is gone (it broke for that).
        self.lost: set[int] = set()

    def __repr__(self) -> str:
        state = f" broken: {self.broken}" if self.broken is not None else ""
        return f"<CommState {self.name} rank={self.rank}/{self.size}{state}>"


class Lane:
    """The issue queue of one backend on one communicator.

    Issue in submission order per lane, never "whichever is ready first": MPI and NCCL match
    collectives by call order, and ready-first lets two ranks issue the same lane's collectives
    in different orders (the sim world's policy tests show the resulting hang).

    Invariants:
    - ``pending`` holds the lane's unissued operations in submission order; only its head may
      be issued, and only once its dependencies have finished and, for a collective, fewer
      than ``window`` of the lane's collectives are in flight.
    - ``issued`` counts the lane's collectives in flight (issued, not settled).
    - ``history`` holds records of the last ``HISTORY`` operations that finished on this lane.
    - ``comm`` is the communicator the lane belongs to; ``comm.lanes`` holds it.
    - ``stream`` is None, or (a stream-ordered backend) the stream of ``group``, where every
      operation of the lane runs in issue order (docs/design.md rule 6: one stream per lane).
    """

    __slots__ = (
        "backend",
        "backend_name",
        "group",
        "comm",
        "comm_name",
        "key",
        "submitted",
        "streams",
        "rank",
        "size",
        "pending",
        "history",
        "track",
        "blocking",
        "spins_alone",
        "in_order",
        "named",
        "window",
        "issued",
        "stream",
        "device",
    )

    def __init__(self, backend: Backend, group: Any, comm: CommState, name: str, track: Track,
                 named: bool = False) -> None:
        self.backend = backend
        self.backend_name = backend.name
        self.group = group
        self.comm = comm
        self.comm_name = name
        #: The lane's name on every member (``backend:communicator``).
        self.key = f"{self.backend_name}:{name}"
        #: Collectives submitted on the lane (the last one's index).
        self.submitted = 0
        #: Sends and receives submitted on the lane, per stream (the last one's index).
        self.streams: dict[tuple[int, int, bool], int] = {}
        self.rank: int = group.rank
        self.size: int = group.size
        self.pending: deque[CommFuture] = deque()
        # Plain tuples in OpRecord's field order (a NamedTuple costs more per operation);
        # the state is the future's state number.
        self.history: deque[tuple[Any, ...]] = deque(maxlen=HISTORY)
        #: The engine's in-flight record of this lane's backend.
        self.track = track
        #: Whether a lone request of this lane may be waited on in the backend (``block``).
        self.blocking: bool = backend.capabilities.blocking_wait
        #: Whether a waiter may test a lone request of this lane in bursts (Engine.poll): its
        #: backend moves data only while polled, and has no threads of its own to starve.
        self.spins_alone: bool = not backend.capabilities.self_progressing
        #: Whether the lane's issued work runs one at a time in issue order (see
        #: Capabilities.in_order): what is behind an operation that never runs never runs.
        self.in_order: bool = backend.capabilities.in_order
        #: Whether the lane runs named operations, placed in the order its members agreed
        #: on (`Names`), not in submission order: only collectives, ordered by ``index``.
        self.named = named
        #: How many of the lane's collectives may be in flight at once (Capabilities.
        #: issue_window; no limit: a number never reached), and how many are.
        self.window: int = backend.capabilities.issue_window or 1 << 62
        self.issued = 0
        #: For a stream-ordered backend, the stream its operations are queued on and the
        #: `Device` it is on (operations on it are ordered by events: ``Engine``); else None.
        self.stream: Any = None
        self.device: Any = None
        if backend.capabilities.stream_ordered:
            self.stream = backend.stream(group)
            if self.stream is None:
                raise TypeError(
                    f"backend {backend.name!r} says its operations are stream_ordered but "
                    f"gives no stream for its group: a stream-ordered backend implements "
                    f"Backend.stream(group)")
            self.device = backend.device

    def take(self, stream: tuple[int, int, bool] | None) -> int:
        """The next position on this lane, the same on every member (their peers match
        operations by it, and rule 7 stops at it): among its collectives (``stream`` None),
        or among the sends or receives of ``stream``."""
        if stream is None:
            self.submitted = n = self.submitted + 1
        elif stream[0] == ANY_PEER:
            return 0  # (none yet: `matched`)
        else:
            self.streams[stream] = n = self.streams.get(stream, 0) + 1
        return n

    def records(self) -> list[OpRecord]:
        """The flight record: the last finished operations of this lane, oldest first."""
        return [OpRecord(k, s, STATE_NAMES[st], n, a, b, c, d)
                for k, s, st, n, a, b, c, d in self.history]

    def __repr__(self) -> str:
        return (
            f"<Lane {self.backend_name}:{self.comm_name} rank={self.rank}/{self.size}"
            f" pending={len(self.pending)}>"
        )


def take_source(fut: CommFuture) -> None:
    """The finishing step of a receive from any source (its ``finish``): it got its message
    from the peer its backend names, and takes its position on that peer's stream now. (No
    receive of its tag was submitted on its lane meanwhile: the communicator refuses them
    until it has finished.)"""
    lane = fut.lane
    _, tag, _ = fut.stream
    fut.stream = stream = (lane.backend.source(fut._request), tag, False)
    fut.index = lane.take(stream)
