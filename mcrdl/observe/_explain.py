"""``python -m mcrdl trace explain DUMPS...``: which operation is stuck, and who is missing.

Reads the machine-readable flight-recorder dumps of the ranks (JSON lines, written on a
timeout, a DesyncError, SIGUSR2 or ``comm.dump_flight_recorder(path)`` when the destination
ends in ``.json``; the last dump of each rank counts). Peers match the collectives of a lane
by position, so on each lane the stuck collective is the earliest position some rank has
unfinished; a member that submitted fewer operations there has not arrived. For each such
member it says what that member waits on instead (the operation a thread of it is blocked
in, else its oldest unfinished one). A send or receive is matched by its peer and tag: for
each unfinished one it says whether the peer posted its counterpart, and what the peer waits
on if not. It follows those waits to find a cycle between ranks (two communicators used in
opposite orders, two ranks that both receive first, a collective that one rank blocks in
while another blocks in a receive from it).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["explain", "load_dumps"]

_P2P = ("send", "recv")


def load_dumps(paths: list[str]) -> dict[int, dict[str, Any]]:
    """The last dump of each rank found in ``paths`` (JSON lines)."""
    by_rank: dict[int, dict[str, Any]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number} is not a flight-recorder dump: {exc}")\
                        from None
                if not isinstance(doc, dict) or "lanes" not in doc or "rank" not in doc:
                    raise ValueError(f"{path}:{number} is not a flight-recorder dump (no lanes)")
                by_rank[int(doc["rank"])] = doc
    return by_rank


def _describe(op: dict[str, Any]) -> str:
    name = f" {op['name']!r}" if op.get("name") else ""
    return (f"{op['op']}#{op['seq']}{name} on {op['lane']} ({op['state'].lower()},"
            f" {op['age_s']:.1f} s)")


def _instead(rank: int, dumps: dict[int, dict[str, Any]]) -> str:
    """What ``rank`` waits on, in words."""
    doc = dumps.get(rank)
    if doc is None:
        return "no dump from it (it died, or was not asked to dump)"
    if doc["waiting_on"]:
        return f"it is blocked waiting for {_describe(doc['waiting_on'][0])}"
    live = [op for lane in doc["lanes"] for op in lane["unfinished"]]
    if live:
        op = max(live, key=lambda o: o["age_s"])
        return f"nothing blocks it; its oldest unfinished operation is {_describe(op)}"
    return ("nothing in flight: its program has not submitted the operation (still "
            "computing, or it skipped it)")


def explain(dumps: dict[int, dict[str, Any]]) -> str:
    """The report (see the module docstring)."""
    if not dumps:
        return "no dumps given"
    lanes: dict[tuple[str, tuple[int, ...]], dict[int, dict[str, Any]]] = {}
    for rank, doc in dumps.items():
        for lane in doc["lanes"]:
            lanes.setdefault((lane["lane"], tuple(lane["members"])), {})[rank] = lane
    stuck = []
    for (key, members), per_rank in sorted(lanes.items()):
        positions = [op["index"] for lane in per_rank.values() for op in lane["unfinished"]
                     if op["index"] is not None and op["op"] not in _P2P]
        if not positions:
            continue
        pos = min(positions)
        issued = {r: op for r, lane in per_rank.items() for op in lane["unfinished"]
                  if op["index"] == pos and op["op"] not in _P2P}
        missing = [m for m in members
                   if m not in per_rank or per_rank[m]["submitted"] < pos]
        finished = [m for m in members if m not in issued and m not in missing]
        stuck.append((key, members, per_rank, pos, issued, missing, finished))
    messages = _messages(dumps)
    lines = [f"dumps of ranks {sorted(dumps)} (world of {next(iter(dumps.values()))['size']})"]
    if not stuck and not messages:
        lines.append("no operation is unfinished in these dumps: nothing is stuck")
        return "\n".join(lines)
    # Who waits for whom: a rank blocked on a stuck operation waits for the ranks missing
    # from it.
    blocking: dict[int, list[tuple[dict[str, Any], list[int]]]] = {}
    for key, members, per_rank, pos, issued, missing, finished in stuck:
        op = next(iter(issued.values()))
        for rank in issued:
            blocking.setdefault(rank, []).append((issued[rank], missing))
        lines.append(f"\nstuck: {op['op']}#{op['seq']} at position {pos} of lane {key}"
                     f" (communicator {op['comm']}, members {list(members)})")
        lines.append(f"  issued by ranks {sorted(issued)}"
                     + (f"; finished or failed on {finished}" if finished else ""))
        if not missing:
            lines.append("  every member issued it: it is in the backend (a slow or lost"
                         " transfer, or a peer that stopped progressing)")
        for m in missing:
            lines.append(f"  not arrived: rank {m} ({_submitted(per_rank, m)});"
                         f" {_instead(m, dumps)}")
    for rank, op, posted in messages:
        peer = op["peer"]
        side = "send" if op["op"] == "recv" else "receive"
        who = "any rank" if peer == "any" else f"rank {peer}"
        lines.append(f"\nstuck: {op['op']}#{op['seq']} on rank {rank}"
                     f" {'from' if op['op'] == 'recv' else 'to'} {who}, tag {op['tag']},"
                     f" on lane {op['lane']} (communicator {op['comm']},"
                     f" {op['state'].lower()}, {op['age_s']:.1f} s)")
        if peer == "any":
            lines.append(f"  a rank posted a send of tag {op['tag']} to it: both sides are in"
                         " the backend" if posted else
                         f"  no rank has posted a send of tag {op['tag']} to it")
        elif posted is None:
            lines.append(f"  rank {peer}: {_instead(peer, dumps)}")
        elif posted:
            lines.append(f"  rank {peer} posted its {side}: both sides are in the backend (a"
                         f" slow or lost transfer, or a peer that stopped progressing)")
        else:
            lines.append(f"  rank {peer} has not posted its {side} with tag {op['tag']};"
                         f" {_instead(peer, dumps)}")
            blocking.setdefault(rank, []).append((op, [peer]))
    waits_for: dict[int, set[int]] = {}
    for rank, doc in dumps.items():
        for op in doc["waiting_on"]:
            for stuck_op, missing in blocking.get(rank, ()):
                if (op["lane"], op["seq"]) == (stuck_op["lane"], stuck_op["seq"]):
                    waits_for.setdefault(rank, set()).update(m for m in missing if m != rank)
    cycle = _cycle(waits_for)
    if cycle:
        lines.append("\na cycle: " + " -> ".join(f"rank {r}" for r in cycle)
                     + f" -> rank {cycle[0]}: each waits for an operation the next has not"
                     " issued (blocking waits in orders that differ between the ranks)")
    return "\n".join(lines)


def _messages(dumps: dict[int, dict[str, Any]]
              ) -> list[tuple[int, dict[str, Any], bool | None]]:
    """Each unfinished send or receive (by rank), and whether its peer posted the
    counterpart (a receive from, or a send to, this rank with its tag on its communicator):
    None where the peer left no dump."""
    found = []
    for rank, doc in sorted(dumps.items()):
        for lane in doc["lanes"]:
            for op in lane["unfinished"]:
                if op["op"] not in _P2P or "peer" not in op:
                    continue
                # A receive from any source: did any rank post a send to it?
                others = ([d for r, d in dumps.items() if r != rank] if op["peer"] == "any"
                          else [dumps[op["peer"]]] if op["peer"] in dumps else [])
                posted = None
                if others:
                    want = "recv" if op["op"] == "send" else "send"
                    posted = any(o["op"] == want and o.get("peer") in (rank, "any")
                                 and o.get("tag") == op["tag"] and o["comm"] == op["comm"]
                                 for other in others for peer_lane in other["lanes"]
                                 for o in peer_lane["unfinished"])
                found.append((rank, op, posted))
    return found


def _submitted(per_rank: dict[int, dict[str, Any]], rank: int) -> str:
    lane = per_rank.get(rank)
    if lane is None:
        return "no record of this lane"
    return f"it submitted {lane['submitted']} operation(s) on this lane"


def _cycle(graph: dict[int, set[int]]) -> list[int] | None:
    """A cycle in ``graph`` (rank -> ranks it waits for), as a list of ranks, or None."""
    state: dict[int, int] = {}
    stack: list[int] = []

    def visit(node: int) -> list[int] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None
