"""Seeing what communication does: the comms log, its summary, and the timeline trace.

Everything comes from timestamps the engine takes anyway (submit, issue, completion): while
the log is on, each finished operation appends one record (``Engine.log``), read only when
a summary or a trace is asked for. Nothing is synchronized, barriered or waited for per
operation, so overlap is what it would be without the log.

- ``MCRDL_LOG=1`` / ``init(log=True)``: ``comm.log_summary()`` (and, on rank 0, a summary at
  ``finalize()``): per (op, backend, size bucket) the count, total and mean latency, p50 and
  p99, algbw and busbw as nccl-tests defines them, gathered over the ranks, naming the
  slowest. Latency is issue to completion, as seen by this rank.
- ``MCRDL_TRACE=path.json`` / ``init(trace=...)``: at ``finalize()`` rank 0 writes one trace in
  the trace-event format (ui.perfetto.dev, chrome://tracing): one process per rank, one track
  per lane, a slice per operation (queued, then in flight), flow arrows for dependencies
  between lanes, and user spans (``with mcrdl.span("forward"):``) on a track of their own;
  clocks aligned to rank 0's at ``init()``.

- While torch's profiler runs, each operation is also a ``record_function`` range
  ``mcrdl.<op>`` in its trace (``Engine.submit``; one attribute test per operation otherwise).

The ranks' records travel through the bootstrap store (as JSON), not through a communicator:
a summary or a trace still comes out when an operation failed and broke its communicator.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["Recorder", "busbw_factor", "format_summary", "plot_trace", "summarize", "summarize_trace",
           "trace_events"]

_STATES = {2: "done", 3: "failed", 4: "cancelled"}  # engine._states: DONE, FAILED, CANCELLED


def algbw_bytes(op: str, nbytes: int, size: int) -> int:
    """The size S nccl-tests divides by the time for algbw: the output of an allgather or a
    gather (n times the input), the input otherwise (reduce_scatter's whole input,
    alltoall's whole buffer)."""
    if op in ("allgather", "gather"):
        return nbytes * size
    return nbytes


def busbw_factor(op: str, size: int) -> float:
    """busbw = algbw x this factor (nccl-tests' PERFORMANCE.md): 2(n-1)/n for allreduce,
    (n-1)/n for allgather, reduce_scatter, alltoall(v), gather and scatter, 1 otherwise."""
    if size <= 1:
        return 1.0
    if op == "allreduce":
        return 2 * (size - 1) / size
    if op in ("allgather", "reduce_scatter", "alltoall", "alltoallv", "gather", "scatter"):
        return (size - 1) / size
    return 1.0


def bucket(nbytes: int) -> int:
    """The size bucket: the smallest power of two >= nbytes (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        return "-"
    name = str(dtype)
    return name.removeprefix("torch.")


class Recorder:
    """The runtime's log and trace: switches the engine's log on, keeps user spans, aligns
    this rank's clock to rank 0's, and turns records into rows and trace events."""

    def __init__(self, engine: Any, rank: int, size: int) -> None:
        self.engine = engine
        self.rank = rank
        self.size = size
        engine.log = []
        #: This rank's clock at init (rank 0's is the trace's zero).
        self.t0: float = engine.now()
        self.spans: list[tuple[str, float, float, str]] = []
        self._span_lock = threading.Lock()
        #: Add to this rank's clock to read rank 0's (seconds); set by `align`.
        self.offset = 0.0
        self.skew_bound = 0.0
        self._gathers: dict[str, int] = {}
        #: Member 0's keys of the last gather every member read, per member list (deleted at
        #: the next gather of those members).
        self._unread: dict[str, list[str]] = {}

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the block it wraps as the user span ``name`` (`mcrdl.span`)."""
        clock = self.engine.now
        start = clock()
        try:
            yield
        finally:
            end = clock()
            with self._span_lock:
                self.spans.append((name, start, end, threading.current_thread().name))

    # -- records ---------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """Every finished operation so far, as dicts: op, seq, backend, comm, lane, size
        (of its communicator), state, dtype, bytes, submit, issue and done (this rank's
        clock, seconds), latency_us (issue to done), algbw and busbw (GB/s)."""
        out = []
        for lane, kind, seq, state, nbytes, dtype, t_submit, t_issue, t_done in list(
                self.engine.log):
            issue = t_issue if t_issue > 0.0 else t_done
            latency = t_done - issue
            algbw = algbw_bytes(kind, nbytes, lane.size) / latency / 1e9 if latency > 0 else 0.0
            out.append({
                "op": kind, "seq": seq, "backend": lane.backend_name, "comm": lane.comm_name,
                "lane": f"{lane.backend_name}:{lane.comm_name}",
                "size": lane.size, "state": _STATES.get(state, str(state)),
                "dtype": _dtype_name(dtype), "bytes": nbytes, "submit": t_submit,
                "issue": issue, "done": t_done, "latency_us": latency * 1e6,
                "algbw": algbw, "busbw": algbw * busbw_factor(kind, lane.size),
            })
        return out

    def edges(self) -> list[tuple[str, int, str, int]]:
        return [(f"{a.backend_name}:{a.comm_name}", sa, f"{b.backend_name}:{b.comm_name}", sb)
                for a, sa, b, sb in list(self.engine.log_edges)]

    # -- clocks ----------------------------------------------------------------------------

    def align(self, store: Any, timeout: float) -> None:
        """Estimate this rank's clock offset to rank 0's through the store: rank 0 answers a
        few pings with its clock; each rank keeps the answer of the shortest round trip, and
        the offset is rank 0's time minus the round trip's midpoint (error within half the
        round trip, recorded as ``skew_bound``)."""
        if self.size <= 1:
            return
        clock = self.engine.now
        wait = datetime.timedelta(seconds=timeout)
        rounds = 5
        if self.rank == 0:
            for r in range(1, self.size):
                for i in range(rounds):
                    key = f"mcrdl/clock/{r}/{i}"
                    store.wait([key + "/ping"], wait)
                    store.set(key + "/pong", repr(clock()))
            return
        best = (float("inf"), 0.0)
        for i in range(rounds):
            key = f"mcrdl/clock/{self.rank}/{i}"
            t0 = clock()
            store.set(key + "/ping", "1")
            store.wait([key + "/pong"], wait)
            theirs = float(store.get(key + "/pong").decode())
            t1 = clock()
            if t1 - t0 < best[0]:
                best = (t1 - t0, theirs - (t0 + t1) / 2)
        self.skew_bound = best[0] / 2
        self.offset = best[1]

    # -- gathering ---------------------------------------------------------------------------

    def gather(self, store: Any, members: Sequence[int], my_index: int, payload: Any,
               timeout: float, everyone: bool = False) -> list[Any] | None:
        """Every member's ``payload`` (JSON-able), in member order: on member 0 only, or on
        every member (``everyone``); None elsewhere. Through the store, so that a broken
        communicator does not stop it; a member that never arrives within ``timeout`` is
        left out (its entry None).

        Member 0 deletes the payloads once nobody needs them (a program that logs a summary
        every N steps would otherwise grow the store by every record of every rank each
        time): this gather's once it read them, where it is their only reader; else the
        previous gather's of the same members, once every member has arrived at this one
        (each read the previous one before)."""
        group = '-'.join(map(str, members))
        # counted per member list: a rank's gathers on other communicators do not shift it
        n = self._gathers[group] = self._gathers.get(group, 0) + 1
        tag = f"mcrdl/gather/{group}/{n}"
        store.set(f"{tag}/{my_index}", json.dumps(payload))
        if my_index != 0 and not everyone:
            return None
        keys = [f"{tag}/{i}" for i in range(len(members))]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - a member gone: gather who came
            return [json.loads(store.get(k).decode()) if store.check([k]) else None
                    for k in keys]
        out = [json.loads(store.get(k).decode()) for k in keys]
        if my_index == 0:
            _delete(store, self._unread.pop(group, []))
            if everyone:
                self._unread[group] = keys
            else:
                _delete(store, keys)
        return out


def _delete(store: Any, keys: list[str]) -> None:
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store that cannot delete keeps them, as before
            return


# -- the summary -------------------------------------------------------------------------

def summarize(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows per (op, backend, size bucket) over every rank's records: count (operations per
    rank), total and mean latency, p50, p99, algbw and busbw (GB/s, from the mean), and the
    slowest rank (largest mean latency)."""
    groups: dict[tuple[str, str, int], dict[int, list[tuple[float, int, int]]]] = {}
    for rank, records in enumerate(per_rank):
        for r in records:
            if r["state"] != "done":
                continue
            key = (r["op"], r["backend"], bucket(r["bytes"]))
            groups.setdefault(key, {}).setdefault(rank, []).append(
                (r["done"] - r["issue"], r["bytes"], r["size"]))
    rows = []
    for (op, backend, size_bucket), by_rank in sorted(groups.items()):
        lat = np.array([t for recs in by_rank.values() for t, _, _ in recs])
        nbytes = np.array([b for recs in by_rank.values() for _, b, _ in recs])
        size = max(s for recs in by_rank.values() for _, _, s in recs)
        means = {rank: float(np.mean([t for t, _, _ in recs])) for rank, recs in by_rank.items()}
        slowest = max(means, key=lambda k: means[k])
        mean = float(lat.mean())
        s_bytes = algbw_bytes(op, int(np.mean(nbytes)), size)
        algbw = s_bytes / mean / 1e9 if mean > 0 else 0.0
        rows.append({
            "op": op, "backend": backend, "bucket": size_bucket, "ranks": len(by_rank),
            "count": int(len(lat) // max(1, len(by_rank))), "total_s": float(lat.sum()),
            "mean_us": mean * 1e6, "p50_us": float(np.percentile(lat, 50)) * 1e6,
            "p99_us": float(np.percentile(lat, 99)) * 1e6, "algbw": algbw,
            "busbw": algbw * busbw_factor(op, size), "slowest_rank": slowest,
            "slowest_mean_us": means[slowest] * 1e6,
        })
    return rows


def _human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def format_summary(rows: list[dict[str, Any]]) -> str:
    """The summary as a table (latencies in µs, bandwidths in GB/s)."""
    head = (f"{'op':<14} {'backend':<8} {'size<=':>7} {'count':>7} {'total ms':>9}"
            f" {'mean':>9} {'p50':>9} {'p99':>9} {'algbw':>8} {'busbw':>8}  slowest rank")
    lines = ["mcrdl comms log (latency: issue to completion, µs; algbw and busbw as nccl-tests,"
             " GB/s; over all ranks)", head]
    for r in rows:
        lines.append(
            f"{r['op']:<14} {r['backend']:<8} {_human(r['bucket']):>7} {r['count']:>7}"
            f" {r['total_s'] * 1e3:9.2f} {r['mean_us']:9.1f} {r['p50_us']:9.1f}"
            f" {r['p99_us']:9.1f} {r['algbw']:8.3f} {r['busbw']:8.3f}"
            f"  {r['slowest_rank']} ({r['slowest_mean_us']:.1f})")
    if not rows:
        lines.append("(no operation finished)")
    return "\n".join(lines)


# -- the trace -----------------------------------------------------------------------------

def trace_events(per_rank: list[dict[str, Any] | None], t0: float) -> list[dict[str, Any]]:
    """Trace events for every rank's payload (``records``, ``edges``, ``spans``, ``offset``;
    None for a rank that did not report), times in µs from ``t0`` (rank 0's clock)."""
    events: list[dict[str, Any]] = []
    flow_id = 0
    for rank, payload in enumerate(per_rank):
        if payload is None:
            continue
        off = payload["offset"]

        def us(t: float, off: float = off) -> float:
            return round((t + off - t0) * 1e6, 3)

        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        tids = {"spans": 1}
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
                       "args": {"name": "user spans"}})
        where: dict[tuple[str, int], tuple[int, float, float]] = {}
        for r in payload["records"]:
            lane = r["lane"]
            if lane not in tids:
                tids[lane] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": rank,
                               "tid": tids[lane], "args": {"name": f"lane {lane}"}})
            tid = tids[lane]
            args = {"seq": r["seq"], "bytes": r["bytes"], "dtype": r["dtype"],
                    "state": r["state"], "comm": r["comm"]}
            if r["issue"] > r["submit"]:
                events.append({"ph": "X", "name": f"{r['op']} (queued)", "cat": "queued",
                               "pid": rank, "tid": tid, "ts": us(r["submit"]),
                               "dur": round((r["issue"] - r["submit"]) * 1e6, 3), "args": args})
            events.append({"ph": "X", "name": r["op"], "cat": r["backend"], "pid": rank,
                           "tid": tid, "ts": us(r["issue"]),
                           "dur": round((r["done"] - r["issue"]) * 1e6, 3), "args": args})
            where[(r["lane"], r["seq"])] = (tid, r["issue"], r["done"])
        for a_lane, a_seq, b_lane, b_seq in payload["edges"]:
            a, b = where.get((a_lane, a_seq)), where.get((b_lane, b_seq))
            if a is None or b is None:
                continue
            flow_id += 1
            events.append({"ph": "s", "name": "depends", "cat": "dependency", "id": flow_id,
                           "pid": rank, "tid": a[0], "ts": us(a[2])})
            events.append({"ph": "f", "bp": "e", "name": "depends", "cat": "dependency",
                           "id": flow_id, "pid": rank, "tid": b[0], "ts": us(b[1])})
        for name, start, end, thread in payload["spans"]:
            events.append({"ph": "X", "name": name, "cat": "span", "pid": rank, "tid": 1,
                           "ts": us(start), "dur": round((end - start) * 1e6, 3),
                           "args": {"thread": thread}})
    return events


# -- reading a trace back: python -m mcrdl trace summary|plot ------------------------------

def _slices(doc: dict[str, Any]) -> tuple[dict[tuple[int, int], str], list[dict[str, Any]]]:
    """Track names by (pid, tid), and the complete ("X") events of a trace."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return names, [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(doc: dict[str, Any]) -> str:
    """Per rank and track: slices, busy time (their union) and the biggest kinds; and how
    much of each rank's communication ran inside user spans (overlapped with the program's
    own work, when its spans mark compute)."""
    names, slices = _slices(doc)
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in slices:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    if not slices:
        return "no slices in this trace"
    t_lo = min(e["ts"] for e in slices)
    t_hi = max(e["ts"] + e["dur"] for e in slices)
    lines = [f"trace over {(t_hi - t_lo) / 1e3:.2f} ms, {len({p for p, _ in by_track})} ranks",
             f"{'rank':>4}  {'track':<28} {'slices':>7} {'busy ms':>9}  biggest"]
    for (pid, tid), events in sorted(by_track.items()):
        busy = _covered([(e["ts"], e["ts"] + e["dur"]) for e in events])
        kinds: dict[str, float] = {}
        for e in events:
            kinds[e["name"]] = kinds.get(e["name"], 0.0) + e["dur"]
        top = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in
                        sorted(kinds.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"{pid:>4}  {names.get((pid, tid), tid):<28} {len(events):>7}"
                     f" {busy / 1e3:9.2f}  {top}")
    for pid in sorted({p for p, _ in by_track}):
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in slices
                if e["pid"] == pid and e.get("cat") not in ("span", "queued")]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in slices
                 if e["pid"] == pid and e.get("cat") == "span"]
        if not comm or not spans:
            continue
        both = _covered([(max(a, c), min(b, d)) for a, b in comm for c, d in spans
                         if min(b, d) > max(a, c)])
        lines.append(f"rank {pid}: {both / 1e3:.2f} of {_covered(comm) / 1e3:.2f} ms of"
                     " communication ran inside user spans")
    return "\n".join(lines)


def plot_trace(doc: dict[str, Any], path: str, title: str = "mcrdl timeline",
               window: tuple[float, float] | None = None) -> None:
    """A PNG timeline: one row per (rank, track), a bar per slice, coloured by backend
    (queued time pale, user spans grey). ``window``: only ``(start, end)`` ms from the
    trace's first slice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    names, slices = _slices(doc)
    if not slices:
        raise ValueError("no slices in this trace: nothing to plot")
    t_lo = min(e["ts"] for e in slices)
    if window is not None:
        lo, hi = t_lo + window[0] * 1e3, t_lo + window[1] * 1e3
        slices = [e for e in slices if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        t_lo = lo
    rows = sorted({(e["pid"], e["tid"]) for e in slices})
    if not rows:
        raise ValueError(f"no slice in the window {window} ms: nothing to plot")
    palette = plt.get_cmap("tab10")
    colours: dict[str, Any] = {"span": (0.6, 0.6, 0.6)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        for e in (e for e in slices if (e["pid"], e["tid"]) == row):
            cat = e.get("cat", "")
            if cat not in colours and cat != "queued":
                colours[cat] = palette(len(colours) % 10)
            colour = colours.get(cat, (0.85, 0.85, 0.95))
            ax.broken_barh([((e["ts"] - t_lo) / 1e3, max(e["dur"] / 1e3, 1e-3))],
                           (y - 0.4, 0.8), facecolors=colour, edgecolors="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p} {names.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    colours["queued"] = (0.85, 0.85, 0.95)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
