"""How much of the engine's cost per operation any Python engine with its guarantees pays.

    python benchmarks/floor.py [--iters 20000] [--runs 3] [--bytes 4] [--ops allreduce]
    mpiexec -n 2 python benchmarks/floor.py --ops allreduce,alltoall --bytes 4,4K,64K,1M,4M
    mpiexec -n 2 python benchmarks/floor.py --barrier on ...

In one process, a communicator of one rank, where MPI finishes an operation at its issue: what
is timed is Python around MPI, nothing else. Under ``mpiexec -n 2``, the same at two ranks,
each call's time taken on the slower rank (as ``benchmarks/overhead.py`` does): what
``overhead.py``'s targets ask, against the least any Python engine with mcrdl's guarantees
pays. Four calls, in five pairs alternated call by call (``common.alternate``, with a
barrier before each call under ``--barrier on``, overhead.py's second mode; medians of each
run):

- ``raw nb``: mpi4py's nonblocking call (``Iallreduce``, ``Ialltoall``, ``Iallgather``,
  ``Ibcast``, ``Ireduce_scatter_block``) on numpy views made once, then its ``Test`` loop
  (the floor column of ``benchmarks/overhead.py``);
- ``straight``: the least that the guarantees of ``docs/design.md`` ask of each operation, written
  as one straight-line function with no call of mcrdl's (a measuring device, not an engine:
  it handles one operation of one kind on one lane and nothing else). It checks each tensor
  (type, dtype, contiguity, device) and that the output matches the input, checks the op (or
  the root), reads the cached choice of backend, makes a descriptor (a slotted object: kind,
  lane, sequence number, position, ranges, result, request, state, times), and under the
  engine's lock checks that the runtime and the communicator are open, numbers it on its
  lane, looks up hazards, stamps its submission time (the always-on timeout), issues it by
  address, records it as in flight; then tests it and settles it under the lock (state,
  completion time, counters, the in-flight record);
- ``seams``: ``straight`` with mcrdl's own parts in place of its stand-ins, still in one
  frame (``seams_call_for``): ``as_buffer`` for each tensor, the communicator's cached
  choice, the engine's descriptor (``CommFuture``), its lane, counters and track under its
  lock, and its one settle path (``Engine._settle``, with the flight recorder's history). It
  issues MPI's call itself, as ``straight`` does;
- ``mcrdl``: ``comm.<op>(t, out=out, backend="mpi").wait()``.

``straight - raw nb`` is what those guarantees cost in Python on this host when nothing is
structured; ``seams - straight`` what mcrdl's seams (the Buffer, the descriptor, the shared
engine state, the settle path that every operation and backend goes through) add at the
least; ``mcrdl - seams`` what the engine's structure (its functions: the front, submission,
issue through the backend's ``start_*``, the lone spin) adds on top. The last columns say
whether each meets ``overhead.py``'s target for ``.wait()`` at that size (against raw nb of
the same pairs; between ranks only): a point the straight function misses is out of reach of
any Python engine with these guarantees on this host, in that minute; a point ``seams``
misses, out of reach of one built on mcrdl's seams. Figures move between hosts: quote the
host (printed first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    alternate,
    host,
    human,
    meets_mpi_target,
    mpi_target,
    op_buffers,
    parse_sizes,
    raw_nonblocking,
)

import mcrdl  # noqa: E402
from mcrdl import ReduceOp  # noqa: E402


class _Op:
    """The descriptor ``straight`` makes per operation (the fields mcrdl's future needs for
    ordering, hazards, the timeout and the result)."""

    __slots__ = ("kind", "lane", "seq", "index", "reads", "writes", "result", "request",
                 "state", "t_submit", "t_done", "nbytes")


class _Lane:
    __slots__ = ("submitted", "issued", "in_flight", "broken")

    def __init__(self) -> None:
        self.submitted = 0
        self.issued = 0
        self.in_flight: list[_Op] = []
        self.broken = None


def straight_call_for(MPI, mpi_comm, kind: str, size: int):  # noqa: N803 - the module's own name
    """The ``straight`` call for ``kind``: submit and wait for one operation on a tensor (and,
    for alltoall, allgather and reduce_scatter, its output tensor), in one frame."""
    tensor_type = torch.Tensor
    dtypes = {torch.float32: (MPI.FLOAT, "float32")}
    reducing = kind in ("allreduce", "reduce_scatter")
    choices = {(kind, "float32", ReduceOp.SUM if reducing else None, "mpi", "cpu"):
               (mpi_comm, MPI.SUM)}
    # (a, b): out holds a/b times the bytes of the input (allreduce and broadcast have no out)
    out_ratio = {"alltoall": (1, 1), "allgather": (size, 1), "reduce_scatter": (1, size)}.get(kind)
    fromaddress = MPI.buffer.fromaddress
    in_place = MPI.IN_PLACE
    lock = threading.Lock()
    clock = time.perf_counter
    lane = _Lane()
    hazards: dict = {}
    state = {"closed": False, "unfinished": 0, "seq": 0}

    def call(t, out=None, op=ReduceOp.SUM, root=0, backend="mpi"):
        # the front: check the buffers and the op or the root, pick the backend
        if not isinstance(t, tensor_type):
            raise TypeError("buf must be a tensor")
        dt = dtypes.get(t.dtype)
        if dt is None or not t.is_contiguous() or not t.is_cpu:
            raise ValueError("buf must be a contiguous host tensor of a carried dtype")
        n = t.nbytes
        addr = t.data_ptr()
        if out_ratio is not None:
            if (not isinstance(out, tensor_type) or out.dtype is not t.dtype
                    or not out.is_contiguous() or not out.is_cpu):
                raise ValueError("out must be a contiguous host tensor of buf's dtype")
            out_n = out.nbytes
            if out_n * out_ratio[1] != n * out_ratio[0]:
                raise ValueError("out's size does not match buf's")
            out_addr = out.data_ptr()
        if reducing:
            if type(op) is not ReduceOp:
                raise TypeError("op must be a ReduceOp")
        else:
            op = None
            if kind == "broadcast" and (type(root) is not int or not 0 <= root < size):
                raise ValueError("root out of range")
        choice = choices.get((kind, dt[1], op, backend, "cpu"))
        if choice is None:
            raise ValueError("no backend")
        comm, mop = choice
        # the descriptor
        fut = _Op()
        fut.kind = kind
        fut.lane = lane
        state["seq"] = fut.seq = state["seq"] + 1
        if out_ratio is None:
            fut.reads = ()
            fut.writes = ((addr, addr + n),)
            fut.result = t
        else:
            fut.reads = ((addr, addr + n),)
            fut.writes = ((out_addr, out_addr + out_n),)
            fut.result = out
        fut.nbytes = n
        fut.state = 0
        # the engine: under its lock, open, numbered, hazards, stamped, issued
        with lock:
            if state["closed"] or lane.broken is not None:
                raise RuntimeError("closed")
            lane.submitted = fut.index = lane.submitted + 1
            state["unfinished"] += 1
            if hazards:
                raise AssertionError("nothing else is in flight here")
            fut.t_submit = clock()
            first = [fromaddress(addr, n), dt[0]]
            if kind == "allreduce":
                req = comm.Iallreduce(in_place, first, mop)
            elif kind == "broadcast":
                req = comm.Ibcast(first, root)
            else:
                last = [fromaddress(out_addr, out_n), dt[0]]
                if kind == "alltoall":
                    req = comm.Ialltoall(first, last)
                elif kind == "allgather":
                    req = comm.Iallgather(first, last)
                else:
                    req = comm.Ireduce_scatter_block(first, last, mop)
            fut.request = req
            fut.state = 1
            lane.issued += 1
            lane.in_flight.append(fut)
        # the wait: test, then settle under the lock
        request = fut.request
        while not request.Test():
            pass
        with lock:
            fut.state = 2
            fut.t_done = clock()
            state["unfinished"] -= 1
            lane.issued -= 1
            lane.in_flight.remove(fut)
            fut.request = None
        return fut.result

    return call


def seams_call_for(MPI, comm, kind: str, size: int):  # noqa: N803 - the module's own name
    """The ``seams`` call for ``kind``: ``straight``, with mcrdl's own parts where ``straight``
    has its stand-ins, each used in line, in one frame: the front's buffer check
    (``as_buffer``, for ``out`` too), the communicator's cached choice, the engine's
    descriptor (``CommFuture``) numbered on the lane and counted by the engine under its lock,
    the backend's track and tables, and the engine's one settle path (``Engine._settle``: the
    flight recorder's history, the counters, hazards, callbacks). A measuring device reaching
    into the engine's internals: valid while nothing else is in flight (it checks)."""
    from mcrdl.core._buffers import as_buffer
    from mcrdl.core._types import OpKind
    from mcrdl.engine import CommFuture
    from mcrdl.engine._states import ISSUED

    engine = comm._engine
    lock = engine._lock
    clock = engine._clock
    op_kind = OpKind(kind)
    reducing = kind in ("allreduce", "reduce_scatter")
    out_ratio = {"alltoall": (1, 1), "allgather": (size, 1), "reduce_scatter": (1, size)}.get(kind)
    fromaddress = MPI.buffer.fromaddress
    in_place = MPI.IN_PLACE
    test = MPI.Request.Test
    burst = range(8)  # tests per hold of the lock, as Engine.poll on a lone request
    cache = comm._choice_cache

    def call(t, out=None, op=ReduceOp.SUM, root=0, backend="mpi"):
        # the front
        b = as_buffer(t, "buf", out_ratio is None)
        if out_ratio is not None:
            o = as_buffer(out, "out", True)
            if o.dtype is not b.dtype or o.device != b.device:
                raise ValueError("out must have buf's dtype and device")
            if o.nbytes * out_ratio[1] != b.nbytes * out_ratio[0]:
                raise ValueError("out's size does not match buf's")
            if o.addr < b.addr + b.nbytes and b.addr < o.addr + o.nbytes:
                raise ValueError("out overlaps buf")
        if reducing:
            if type(op) is not ReduceOp:
                raise TypeError("op must be a ReduceOp")
        else:
            op = None
            if kind == "broadcast" and (type(root) is not int or not 0 <= root < size):
                raise ValueError("root out of range")
        choice = cache.get((op_kind, b.dtype, op, backend, b.device))
        if choice is None:
            choice = comm._decide(op_kind, b.dtype, op, backend, b.device)
        slot, _ = choice
        lane = slot.lane
        be = slot.backend
        comm._seq = seq = comm._seq + 1
        if out_ratio is None:
            fut = CommFuture(kind, lane, seq, None, None, (), b.ranges, t, b.nbytes)
        else:
            fut = CommFuture(kind, lane, seq, None, None, b.ranges, o.ranges, out, b.nbytes,
                             None, t)
        # the engine: under its lock, open, numbered, counted, issued, in its track
        fut._engine = engine
        fut.t_submit = engine.last_active = now = clock()
        with lock:
            if engine._closed or lane.comm.broken is not None:
                raise RuntimeError("closed")
            if (engine._hazards.conflicts(fut) or lane.pending
                    or lane.issued >= lane.window):
                raise AssertionError("nothing else is in flight here")
            fut.index = lane.take(None)
            engine._unfinished += 1
            mpi_comm = slot.group.comm
            mtype = be._types[b.dtype]
            first = [fromaddress(b.addr, b.nbytes), mtype]
            if kind == "allreduce":
                req = mpi_comm.Iallreduce(in_place, first, be._mops[b.dtype, op])
            elif kind == "broadcast":
                req = mpi_comm.Ibcast(first, root)
            else:
                last = [fromaddress(o.addr, o.nbytes), mtype]
                if kind == "alltoall":
                    req = mpi_comm.Ialltoall(first, last)
                elif kind == "allgather":
                    req = mpi_comm.Iallgather(first, last)
                else:
                    req = mpi_comm.Ireduce_scatter_block(first, last, be._mops[b.dtype, op])
            fut.t_issue = now
            fut._state = ISSUED
            lane.issued += 1
            fut._request = req
            track = lane.track
            track.add(fut, req)
        # the wait: tests in bursts under the lock, then the engine's settle
        engine.drivers += 1
        try:
            while fut._state == ISSUED:
                with lock:
                    for _ in burst:
                        if test(req):
                            track.empty()
                            engine._settle(fut, None)
                            break
        finally:
            engine.drivers -= 1
        return fut.result()

    return call


OPS = ("allreduce", "alltoall", "allgather", "broadcast", "reduce_scatter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bytes", default="4", help="message sizes: 4, or 4,4K,64K, or 4:1M")
    ap.add_argument("--ops", default="allreduce", help=f"comma-separated, of {','.join(OPS)}")
    ap.add_argument("--barrier", choices=("on", "off"), default="off",
                    help="a barrier before each call, untimed (overhead.py's second mode)")
    args = ap.parse_args()
    ops = args.ops.split(",")
    for op in ops:
        if op not in OPS:
            ap.error(f"--ops: {op!r} is not one of {', '.join(OPS)}")
    comm = mcrdl.init()
    from mpi4py import MPI

    raw_comm = MPI.COMM_WORLD.Dup()
    n = comm.size
    sync = raw_comm.Barrier if args.barrier == "on" else None
    if comm.rank == 0:
        print(f"# {host()}")
        print(f"# {n} rank(s), µs per call (medians of {args.iters} alternated calls per pair "
              f"and run{'; each call the slowest rank' if n > 1 else ''}; barrier "
              f"{args.barrier}); target: overhead.py's for .wait() against raw nb, met or not "
              f"by each")
        print(f"{'op':<14} {'bytes':>6} {'run':>3} | {'raw nb':>7} {'straight':>8} {'seams':>7} "
              f"{'mcrdl':>7} | {'straight - raw':>14} {'seams - straight':>16} "
              f"{'mcrdl - seams':>13} {'mcrdl - raw':>11} | {'target':>6} {'straight':>8} "
              f"{'seams':>5} {'mcrdl':>5}")
    for op in ops:
        straight_call = straight_call_for(MPI, raw_comm, op, n)
        seams_call = seams_call_for(MPI, comm, op, n)
        for nbytes in parse_sizes(args.bytes):
            row = _point(op, nbytes, n, args, comm, raw_comm, MPI, straight_call, seams_call,
                         sync)
            if comm.rank == 0:
                for line in row:
                    print(line, flush=True)
    raw_comm.Free()
    mcrdl.finalize()


def _point(op, nbytes, n, args, comm, raw_comm, MPI, straight_call, seams_call,  # noqa: N803
           sync) -> list[str]:
    """``args.runs`` rows for ``op`` at ``nbytes`` (printed on rank 0)."""
    t, out = op_buffers(op, nbytes, n)
    raw = raw_nonblocking(MPI, raw_comm, op, t, out)
    method = getattr(comm, op)
    in_place = op in ("allreduce", "broadcast")  # (out is then unused, and unwritten)
    kwargs = {} if in_place else {"out": out}
    results = (t,) if in_place else (t, out)

    def straight() -> None:
        straight_call(t, out)

    def seams() -> None:
        seams_call(t, out)

    def engine() -> None:
        method(t, backend="mpi", **kwargs).wait()

    # the calls give the same result
    raw()
    expected = [r.clone() for r in results]
    for call in (straight, seams, engine):
        call()
        assert all(map(torch.equal, results, expected)), f"{op}: {call.__name__}"
    iters = max(200, min(args.iters, args.iters * 4096 // max(4096, nbytes)))
    lines = []
    for run in range(args.runs):
        for _ in range(max(100, iters // 10)):  # warm every path
            raw()
            straight()
            seams()
            engine()
        pairs = [alternate(raw, straight, iters, sync), alternate(straight, seams, iters, sync),
                 alternate(seams, engine, iters, sync), alternate(raw, seams, iters, sync),
                 alternate(raw, engine, iters, sync)]
        # each call's time on the slowest rank (the ranks make the calls in step)
        (r1, s1), (s2, e2), (e3, m3), (r4, e4), (r5, m5) = [
            tuple(np.max(raw_comm.allgather(np.array(x)), axis=0) for x in pair)
            for pair in pairs]
        us = 1e6
        med = statistics.median
        rw = med(np.concatenate([r1, r4, r5])) * us
        st = med(np.concatenate([s1, s2])) * us
        se = med(np.concatenate([e2, e3, e4])) * us
        mc = med(np.concatenate([m3, m5])) * us
        # the differences from the pairs that hold both calls (each pair sees one machine)
        d_sr = med(s1 - r1) * us
        d_es = med(e2 - s2) * us
        d_me = med(m3 - e3) * us
        d_mr = med(m5 - r5) * us

        def verdict(raw_s: float, call_s: float) -> str:
            if n == 1:  # the targets are for operations between ranks
                return "-"
            return "ok" if meets_mpi_target(nbytes, raw_s, call_s) else "MISS"

        lines.append(
            f"{op:<14} {human(nbytes):>6} {run:>3} | {rw:7.2f} {st:8.2f} {se:7.2f} {mc:7.2f} | "
            f"{d_sr:+14.2f} {d_es:+16.2f} {d_me:+13.2f} {d_mr:+11.2f} | "
            f"{mpi_target(nbytes):>6} {verdict(med(r1), med(s1)):>8} "
            f"{verdict(med(r4), med(e4)):>5} {verdict(med(r5), med(m5)):>5}")
    return lines


if __name__ == "__main__":
    main()
