"""Lanes: one ordered issue queue per (backend, communicator), and its flight record."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ..backends import Backend
    from ._future import CommFuture

__all__ = ["Lane", "OpRecord", "flight_record"]

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


class Lane:
    """The issue queue of one backend on one communicator.

    Issue in submission order per lane, never "whichever is ready first": MPI and NCCL match
    collectives by call order, and ready-first lets two ranks issue the same lane's collectives
    in different orders (the sim world's policy tests show the resulting hang).

    Invariants:
    - ``pending`` holds the lane's unissued operations in submission order; only its head may
      be issued, and only once its dependencies have finished.
    - ``history`` holds records of the last ``HISTORY`` operations that finished on this lane.
    """

    __slots__ = (
        "backend",
        "backend_name",
        "group",
        "comm_name",
        "rank",
        "size",
        "pending",
        "history",
        "closed",
        "track",
        "blocking",
    )

    def __init__(self, backend: Backend, group: Any, comm_name: str) -> None:
        self.backend = backend
        self.backend_name = backend.name
        self.group = group
        self.comm_name = comm_name
        self.rank: int = group.rank
        self.size: int = group.size
        self.pending: deque[CommFuture] = deque()
        # Plain tuples in OpRecord's field order (a NamedTuple costs 0.4 µs more per op);
        # the state is the future's state number.
        self.history: deque[tuple[Any, ...]] = deque(maxlen=HISTORY)
        self.closed = False
        #: The engine's in-flight record of this lane's backend (set by the engine).
        self.track: Any = None
        #: Whether a lone request of this lane may be waited on in the backend (``block``).
        self.blocking: bool = backend.capabilities.blocking_wait

    def records(self) -> list[OpRecord]:
        """The flight record: the last finished operations of this lane, oldest first."""
        from ._future import STATE_NAMES

        return [OpRecord(k, s, STATE_NAMES[st], n, a, b, c, d)
                for k, s, st, n, a, b, c, d in self.history]

    def __repr__(self) -> str:
        return (
            f"<Lane {self.backend_name}:{self.comm_name} rank={self.rank}/{self.size}"
            f" pending={len(self.pending)}>"
        )


def _line(kind: str, seq: int, state: str, nbytes: int, t_submit: float, t_issue: float,
          t_done: float, detail: str, now: float) -> str:
    issued = f"issued {now - t_issue:9.6f}s ago" if t_issue else "not issued"
    done = f"finished after {t_done - t_submit:.6f}s" if t_done else f"age {now - t_submit:.6f}s"
    extra = f" {detail}" if detail else ""
    return f"    {kind + '#' + str(seq):<22} {state:<9} {nbytes:>12} B  {issued}  {done}{extra}"


def flight_record(engine: Any, now: float | None = None) -> str:
    """The flight recorder: per lane, its last finished operations and all unfinished ones."""
    from ._future import STATE_NAMES

    if now is None:
        now = engine._clock()
    unfinished: dict[Lane, list[Any]] = {}
    for track in engine._track_list:
        for f, _ in track.items():
            unfinished.setdefault(f.lane, []).append(f)
    lines = ["mcrdl flight recorder (oldest first; times relative to now)"]
    for lane in engine._lanes.values():
        live = sorted(unfinished.get(lane, []), key=lambda f: f.t_submit)
        live.extend(f for f in lane.pending if f._state == 0)
        if not live and not lane.history:
            continue
        lines.append(f"  lane {lane.backend_name}:{lane.comm_name} rank {lane.rank}/{lane.size}")
        for kind, seq, state, nbytes, t_submit, t_issue, t_done, detail in lane.history:
            lines.append(_line(kind, seq, STATE_NAMES[state], nbytes, t_submit, t_issue, t_done,
                               detail, now))
        for f in live:
            lines.append(_line(f.kind, f.seq, STATE_NAMES[f._state], f.nbytes, f.t_submit,
                               f.t_issue, 0.0, "", now))
    return "\n".join(lines)
