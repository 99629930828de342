"""The flight recorder: each lane's last finished operations and its unfinished ones, as text
for people and as a dump for ``python -m mcrdl trace explain``.

Both read the engine through its named methods, with its lock held by the caller (a timeout
takes them in the engine's hook before it gives the expired operations up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine import ANY_PEER, Lane, OpRecord
from ..engine._states import DONE, PENDING, STATE_NAMES

if TYPE_CHECKING:
    from ..engine import CommFuture, Engine

__all__ = ["flight_dump", "flight_record"]


def _line(rec: OpRecord, now: float) -> str:
    issued = f"issued {now - rec.t_issue:9.6f}s ago" if rec.t_issue else "not issued"
    done = (f"finished after {rec.t_done - rec.t_submit:.6f}s" if rec.t_done
            else f"age {now - rec.t_submit:.6f}s")
    extra = f" {rec.detail}" if rec.detail else ""
    name = f"{rec.kind}#{rec.seq}"
    return f"    {name:<22} {rec.state:<9} {rec.nbytes:>12} B  {issued}  {done}{extra}"


def flight_record(engine: Engine, now: float | None = None) -> str:
    """The flight recorder: per lane, its last finished operations and all unfinished ones."""
    if now is None:
        now = engine.now()
    unfinished: dict[Lane, list[CommFuture]] = {}
    for f in engine.issued_locked():
        unfinished.setdefault(f.lane, []).append(f)
    lines = ["mcrdl flight recorder (oldest first; times relative to now)"]
    for lane in engine.lanes():
        live = sorted(unfinished.get(lane, []), key=lambda f: f.t_submit)
        live.extend(f for f in lane.pending if f._state == PENDING)
        if not live and not lane.history:
            continue
        lines.append(f"  lane {lane.backend_name}:{lane.comm_name} rank {lane.rank}/{lane.size}")
        for rec in lane.records():
            lines.append(_line(rec, now))
        for f in live:
            rec = OpRecord(f.kind, f.seq, STATE_NAMES[f._state], f.nbytes, f.t_submit,
                           f.t_issue, 0.0, _peer_text(f))
            lines.append(_line(rec, now))
    for names in engine.agreements():
        lines.extend(names.waiting(now))
    return "\n".join(lines)


def _peer_text(f: CommFuture) -> str:
    """``to rank 2 tag 5`` for a send (world ranks), ``from rank 2 tag 5`` for a receive,
    empty for a collective."""
    if f.stream is None:
        return ""
    peer, tag, sends = f.stream
    if peer == ANY_PEER:
        return f"from any rank tag {tag}"
    return f"{'to' if sends else 'from'} rank {f.lane.comm.members[peer]} tag {tag}"


def _op(f: CommFuture, now: float) -> dict[str, Any]:
    """An operation in a dump; a send or receive with its peer (a world rank) and tag."""
    op = {"op": f.kind, "seq": f.seq, "state": STATE_NAMES[f._state],
          "index": getattr(f, "index", None), "name": f.name, "bytes": f.nbytes,
          "issued": bool(f.t_issue), "age_s": round(now - f.t_submit, 6),
          "lane": f.lane.key, "comm": f.lane.comm_name}
    if f.stream is not None:
        peer = f.stream[0]
        op["peer"] = "any" if peer == ANY_PEER else f.lane.comm.members[peer]
        op["tag"] = f.stream[1]
    return op


def flight_dump(engine: Engine, waiting: list[CommFuture], now: float | None = None) -> dict[str, Any]:
    """The flight recorder in a machine-readable form (``python -m mcrdl trace explain``
    reads the dumps of all ranks): per lane, its members (world ranks), how many operations
    this rank submitted there, its unfinished ones with their positions, and its last
    finished ones; and the operations this rank's threads are blocked waiting for. The
    caller holds the engine's lock."""
    if now is None:
        now = engine.now()
    unfinished: dict[Lane, list[CommFuture]] = {}
    for fut in engine.unfinished_locked():
        unfinished.setdefault(fut.lane, []).append(fut)
    lanes = []
    for lane in engine.lanes():
        live = sorted(unfinished.get(lane, []), key=lambda f: f.t_submit)
        lanes.append({
            "lane": lane.key, "backend": lane.backend_name, "comm": lane.comm_name,
            "named": lane.named, "rank": lane.rank, "size": lane.size,
            "members": list(lane.comm.members), "broken": lane.comm.broken,
            "submitted": lane.submitted,
            "unfinished": [_op(f, now) for f in live],
            "finished": [{"op": r.kind, "seq": r.seq, "state": r.state, "bytes": r.nbytes}
                         for r in lane.records()[-8:]],
        })
    return {"lanes": lanes, "waiting_on": [_op(f, now) for f in waiting if f._state < DONE]}
