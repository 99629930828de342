"""How much of the engine's cost per operation any Python engine with its guarantees pays.

    python benchmarks/floor.py [--iters 20000] [--runs 3] [--bytes 4]
    mpiexec -n 2 python benchmarks/floor.py --bytes 4,4K,64K,256K,1M

In one process, a communicator of one rank, where MPI finishes an allreduce at its issue: what
is timed is Python around MPI, nothing else. Under ``mpiexec -n 2``, the same at two ranks,
each call's time taken on the slower rank (as ``benchmarks/overhead.py`` does): what
``overhead.py``'s targets ask, against the least any Python engine with mcrdl's guarantees
pays. Three calls, alternated call by call (``common.alternate``; medians of each run):

- ``raw nb``: mpi4py's ``Iallreduce`` on a numpy view made once, then its ``Test`` loop (the
  floor column of ``benchmarks/overhead.py``);
- ``straight``: the least that the guarantees of ``DESIGN.md`` ask of each operation, written
  as one straight-line function with no call of mcrdl's (a measuring device, not an engine:
  it handles one allreduce of one tensor on one lane and nothing else). It checks the tensor
  (type, dtype, contiguity, device), checks the op, reads the cached choice of backend, makes
  a descriptor (a slotted object: kind, lane, sequence number, position, ranges, result,
  request, state, times), and under the engine's lock checks that the runtime and the
  communicator are open, numbers it on its lane, looks up hazards, stamps its submission time
  (the always-on timeout), issues it by address, records it as in flight; then tests it and
  settles it under the lock (state, completion time, counters, the in-flight record);
- ``mcrdl``: ``comm.allreduce(t, backend="mpi").wait()``.

``straight - raw nb`` is what those guarantees cost in Python on this host when nothing is
structured; ``mcrdl - straight`` is what the engine's structure (its functions, the lanes and
tracks shared by every operation and backend) adds. Figures move between hosts: quote the
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

import mcrdl  # noqa: E402
from common import alternate, host, human, parse_sizes  # noqa: E402
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


def straight_allreduce(MPI, mpi_comm):  # noqa: N803 - the module's own name
    """The ``straight`` call: submit and wait for one allreduce of a tensor, in one frame."""
    tensor_type = torch.Tensor
    dtypes = {torch.float32: (MPI.FLOAT, "float32")}
    choices = {("allreduce", "float32", ReduceOp.SUM, "mpi", "cpu"): (mpi_comm, MPI.SUM)}
    fromaddress = MPI.buffer.fromaddress
    in_place = MPI.IN_PLACE
    lock = threading.Lock()
    clock = time.perf_counter
    lane = _Lane()
    hazards: dict = {}
    state = {"closed": False, "unfinished": 0, "seq": 0}

    def call(t, op=ReduceOp.SUM, backend="mpi"):
        # the front: check the buffer and the op, pick the backend
        if not isinstance(t, tensor_type):
            raise TypeError("buf must be a tensor")
        dt = dtypes.get(t.dtype)
        if dt is None or not t.is_contiguous():
            raise ValueError("buf must be a contiguous tensor of a carried dtype")
        device = "cpu" if t.is_cpu else str(t.device)
        n = t.nbytes
        addr = t.data_ptr()
        if type(op) is not ReduceOp:
            raise TypeError("op must be a ReduceOp")
        choice = choices.get(("allreduce", dt[1], op, backend, device))
        if choice is None:
            raise ValueError("no backend")
        comm, mop = choice
        # the descriptor
        fut = _Op()
        fut.kind = "allreduce"
        fut.lane = lane
        state["seq"] = fut.seq = state["seq"] + 1
        fut.reads = ()
        fut.writes = ((addr, addr + n),)
        fut.result = t
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
            fut.request = comm.Iallreduce(in_place, [fromaddress(addr, n), dt[0]], mop)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bytes", default="4", help="message sizes: 4, or 4,4K,64K, or 4:1M")
    args = ap.parse_args()
    comm = mcrdl.init()
    from mpi4py import MPI

    raw_comm = MPI.COMM_WORLD.Dup()
    n = comm.size
    straight_call = straight_allreduce(MPI, raw_comm)
    if comm.rank == 0:
        print(f"# {host()}")
        print(f"# allreduce on {n} rank(s), µs per call (medians of {args.iters} alternated "
              f"calls per pair and run{'; each call the slowest rank' if n > 1 else ''})")
        print(f"{'bytes':>6} {'run':>3} | {'raw nb':>7} {'straight':>8} {'mcrdl':>7} | "
              f"{'straight - raw':>14} {'mcrdl - straight':>16} {'mcrdl - raw':>11}")
    for nbytes in parse_sizes(args.bytes):
        # zeros: the sum over any number of ranks leaves them as they are
        t = torch.zeros(max(1, nbytes // 4))
        a = t.numpy()

        def raw() -> None:
            req = raw_comm.Iallreduce(MPI.IN_PLACE, a)
            while not req.Test():
                pass

        def straight() -> None:
            straight_call(t)

        def engine() -> None:
            comm.allreduce(t, backend="mpi").wait()

        # the calls give the same result
        straight()
        engine()
        assert not t.any()
        iters = max(200, min(args.iters, args.iters * 4096 // max(4096, nbytes)))
        for run in range(args.runs):
            for _ in range(max(100, iters // 10)):  # warm every path
                raw()
                straight()
                engine()
            pairs = [alternate(raw, straight, iters), alternate(straight, engine, iters),
                     alternate(raw, engine, iters)]
            # each call's time on the slowest rank (the ranks make the calls in step)
            (r1, s1), (s2, m2), (r3, m3) = [
                tuple(np.max(raw_comm.allgather(np.array(x)), axis=0) for x in pair)
                for pair in pairs]
            if comm.rank:
                continue
            us = 1e6
            med = statistics.median
            rw = med(np.concatenate([r1, r3])) * us
            st = med(np.concatenate([s1, s2])) * us
            mc = med(np.concatenate([m2, m3])) * us
            # the differences from the pairs that hold both calls (each pair sees one machine)
            d_sr = med(s1 - r1) * us
            d_ms = med(m2 - s2) * us
            d_mr = med(m3 - r3) * us
            print(f"{human(nbytes):>6} {run:>3} | {rw:7.2f} {st:8.2f} {mc:7.2f} | "
                  f"{d_sr:+14.2f} {d_ms:+16.2f} {d_mr:+11.2f}", flush=True)
    raw_comm.Free()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
