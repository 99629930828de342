"""mcrdl's cost over the raw backends, measured side by side in one run.

    mpiexec -n 2 python benchmarks/overhead.py                 # latency tables, 4 B .. 64 MiB
    mpiexec -n 4 python benchmarks/overhead.py --sizes 4:4K    # oversubscribed: 4 ranks, 2 cores
    mpiexec -n 2 python benchmarks/overhead.py --section inflight

For each operation and size it times, interleaved: raw mpi4py's nonblocking call with a
``Test`` loop (the floor of any nonblocking engine, and what every mcrdl-over-mpi figure is
compared with), its blocking call, raw torch.distributed gloo (blocking), and mcrdl on each
backend with ``.wait()`` and with ``await`` (uvloop), all on the same tensors. Calls are
timed in alternating pairs; each cell is the median over calls of the slowest rank's time
(nccl-tests reports the slowest rank). The MPI columns are measured twice: back to back, and
with a barrier before each call (``--barrier``: the shape of a training step, where compute
ran before the first collective and the ranks arrive together). The last column checks the
issue targets of mcrdl over mpi against raw nb. The ``inflight`` section submits N
independent operations before waiting for any and reports the cost per operation as N grows
from 10 to 10,000.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    alternate,
    host,
    human,
    meets_mpi_target,
    op_buffers,
    parse_sizes,
    raw_nonblocking,
)

import mcrdl  # noqa: E402

OPS = ("allreduce", "alltoall", "allgather", "broadcast", "reduce_scatter")


class Pair(NamedTuple):
    """Two calls timed in alternating pairs, reduced over the ranks.

    ``a`` and ``b``: the median over calls of the slowest rank's time; ``ratio``: the median
    of the per-pair ratios B/A (a drift of the machine between pairs cancels in it);
    ``a_rank`` and ``b_rank``: each rank's own median, then the slowest rank's (nccl-tests'
    reduction over ranks, with a median against this machine's noise). The per-call figures
    are the stricter: they charge every call with whatever skew between the ranks it absorbed.
    """

    a: float
    b: float
    ratio: float
    a_rank: float
    b_rank: float


def iters_for(nbytes: int, scale: float) -> int:
    """A rank-invariant iteration count (timing-based counts desynchronize ranks)."""
    if nbytes <= 4096:
        n = 2000
    elif nbytes <= 1 << 20:
        n = 200
    elif nbytes <= 16 << 20:
        n = 20
    else:
        n = 6
    return max(3, int(n * scale))


class Bench:
    def __init__(self, comm: mcrdl.Communicator) -> None:
        import torch.distributed as dist
        from mpi4py import MPI

        self.comm = comm
        self.MPI = MPI
        self.n = comm.size
        self.raw_mpi = MPI.COMM_WORLD.Dup()
        self.alone = comm.split(comm.rank)  # a communicator of one: MPI finishes at issue
        self.raw_alone = self.raw_mpi.Split(comm.rank)
        self.gc_time = 0.0
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc_watch)
        store = dist.PrefixStore("bench/raw", comm.runtime.bootstrap.store())
        dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
        self.dist = dist

    def sync(self) -> None:
        self.raw_mpi.Barrier()

    def slowest(self, value: float) -> float:
        return self.raw_mpi.allreduce(value, op=self.MPI.MAX)

    # -- the methods, one callable per (op, method) ----------------------------------------

    def raw_mpi_call(self, op: str, t: torch.Tensor, out: torch.Tensor):
        a, o, c, IN_PLACE = t.numpy(), out.numpy(), self.raw_mpi, self.MPI.IN_PLACE
        return {
            "allreduce": lambda: c.Allreduce(IN_PLACE, a),
            "alltoall": lambda: c.Alltoall(a, o),
            "allgather": lambda: c.Allgather(a, o),
            "broadcast": lambda: c.Bcast(a, 0),
            "reduce_scatter": lambda: c.Reduce_scatter_block(a, o),
        }[op]

    def raw_mpi_nonblocking(self, op: str, t: torch.Tensor, out: torch.Tensor, c=None):
        return raw_nonblocking(self.MPI, self.raw_mpi if c is None else c, op, t, out)

    def raw_gloo_call(self, op: str, t: torch.Tensor, out: torch.Tensor):
        d = self.dist
        # all_gather_single where torch has it: its deprecated alias warns on every call.
        gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
        return {
            "allreduce": lambda: d.all_reduce(t),
            "alltoall": lambda: d.all_to_all_single(out, t),
            "allgather": lambda: gather(out, t),
            "broadcast": lambda: d.broadcast(t, 0),
            "reduce_scatter": lambda: scatter(out, t),
        }[op]

    def mcrdl_submit(self, op: str, t: torch.Tensor, out: torch.Tensor, backend: str):
        c = self.comm
        return {
            "allreduce": lambda: c.allreduce(t, backend=backend),
            "alltoall": lambda: c.alltoall(t, out=out, backend=backend),
            "allgather": lambda: c.allgather(t, out=out, backend=backend),
            "broadcast": lambda: c.broadcast(t, 0, backend=backend),
            "reduce_scatter": lambda: c.reduce_scatter(t, out=out, backend=backend),
        }[op]

    def mcrdl_wait(self, op: str, t: torch.Tensor, out: torch.Tensor, backend: str, c=None):
        """Submit and wait in one call, as a training loop writes it (no extra frame)."""
        c = self.comm if c is None else c
        return {
            "allreduce": lambda: c.allreduce(t, backend=backend).wait(),
            "alltoall": lambda: c.alltoall(t, out=out, backend=backend).wait(),
            "allgather": lambda: c.allgather(t, out=out, backend=backend).wait(),
            "broadcast": lambda: c.broadcast(t, 0, backend=backend).wait(),
            "reduce_scatter": lambda: c.reduce_scatter(t, out=out, backend=backend).wait(),
        }[op]

    # -- timing ------------------------------------------------------------------------

    def time_pair(self, call_a, call_b, iters: int, barrier: bool = False) -> Pair:
        """Time two calls alternately, so that both see the same machine (it drifts here);
        ``barrier``: with a barrier before each call."""
        self.sync()
        for _ in range(min(10, iters)):
            call_a()
            call_b()
        self.sync()
        a, b = alternate(call_a, call_b, iters, self.sync if barrier else None)
        return self._pair(a, b, iters)

    def _pair(self, a: list[float], b: list[float], iters: int) -> Pair:
        mine = np.array([np.median(a), np.median(b)])
        self.raw_mpi.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MAX)
        per_call = np.array(a + b)
        self.raw_mpi.Allreduce(self.MPI.IN_PLACE, per_call, op=self.MPI.MAX)
        a_s, b_s = per_call[:iters], per_call[iters:]
        return Pair(float(np.median(a_s)), float(np.median(b_s)), float(np.median(b_s / a_s)),
                    float(mine[0]), float(mine[1]))

    def time_pair_async(self, call_a, submit_b, iters: int, barrier: bool = False) -> Pair:
        """``time_pair`` with B awaited (``await submit_b()``) inside a running event loop
        (uvloop when installed); A, a plain blocking call, runs in the same loop."""
        sync = self.sync if barrier else (lambda: None)

        async def run() -> tuple[list[float], list[float]]:
            for _ in range(min(10, iters)):
                call_a()
                await submit_b()
            self.sync()
            a: list[float] = []
            b: list[float] = []
            clock = time.perf_counter
            for i in range(iters):
                sync()
                if i % 2 == 0:
                    t0 = clock()
                    call_a()
                    a.append(clock() - t0)
                    sync()
                    t0 = clock()
                    await submit_b()
                    b.append(clock() - t0)
                else:
                    t0 = clock()
                    await submit_b()
                    b.append(clock() - t0)
                    sync()
                    t0 = clock()
                    call_a()
                    a.append(clock() - t0)
            return a, b

        self.sync()
        try:
            import uvloop

            a, b = uvloop.run(run())
        except ImportError:
            a, b = asyncio.run(run())
        return self._pair(a, b, iters)

    def buffers(self, op: str, nbytes: int, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``common.op_buffers`` for a communicator of ``n`` ranks (default: the world)."""
        return op_buffers(op, nbytes, n or self.n)

    def mpi_point(self, op: str, nbytes: int, scale: float, barrier: bool) -> dict[str, float]:
        """mcrdl over mpi against raw nb (Ixxx + Test loop), and raw blocking against it."""
        t, out = self.buffers(op, nbytes)
        iters = iters_for(nbytes, scale)
        floor = self.raw_mpi_nonblocking(op, t, out)
        wait = self.time_pair(floor, self.mcrdl_wait(op, t, out, "mpi"), iters, barrier)
        blocking = self.time_pair(floor, self.raw_mpi_call(op, t, out), iters, barrier)
        awaited = self.time_pair_async(floor, self.mcrdl_submit(op, t, out, "mpi"), iters,
                                       barrier)
        # Every figure is reduced over the ranks already (Pair): the same on every rank.
        return {"nb": wait.a, "wait": wait.b, "nb_rank": wait.a_rank, "wait_rank": wait.b_rank,
                "blocking": blocking.b, "await_nb": awaited.a, "await": awaited.b}

    def floor_point(self, op: str, nbytes: int, scale: float) -> dict[str, float]:
        """The engine's own cost per operation: mcrdl's ``.wait()`` against raw nb on a
        communicator of one rank, where MPI finishes at issue. An operation between ranks pays
        it at least once (its front before the issue, its settle after), so mcrdl's excess
        over raw nb at 2 ranks cannot be below it."""
        t, out = self.buffers(op, nbytes, 1)
        iters = 5 * iters_for(nbytes, scale)
        pair = self.time_pair(self.raw_mpi_nonblocking(op, t, out, self.raw_alone),
                              self.mcrdl_wait(op, t, out, "mpi", self.alone), iters)
        return {"nb": pair.a, "wait": pair.b}

    def gloo_point(self, op: str, nbytes: int, scale: float) -> dict[str, float]:
        """mcrdl over gloo against raw torch.distributed gloo, with raw gloo's A/A noise."""
        t, out = self.buffers(op, nbytes)
        iters = iters_for(nbytes, scale)
        # gloo's ratios need more pairs than MPI's at large sizes: its times spread more here.
        giters = max(3, iters // 4) if nbytes <= 4096 else max(iters, int(40 * scale))
        raw_gloo = self.raw_gloo_call(op, t, out)
        wait = self.time_pair(raw_gloo, self.mcrdl_wait(op, t, out, "gloo"), giters)
        # The noise floor of that ratio: raw gloo timed against itself, the same way.
        aa = self.time_pair(raw_gloo, raw_gloo, giters)
        awaited = self.time_pair_async(raw_gloo, self.mcrdl_submit(op, t, out, "gloo"), giters)
        return {"raw": wait.a, "wait": wait.b, "ratio": wait.ratio, "aa": aa.ratio,
                "await": awaited.b, "await_ratio": awaited.ratio}

    def inflight_point(self, count: int, reps: int) -> dict[str, float]:
        """Submit ``count`` independent 4-byte allreduces on mpi, then wait for all.

        Three figures per op: raw mpi4py (Iallreduce x count, Waitall) and mcrdl on the world
        (both include MPICH's own cost, which grows with the requests it has in flight), and
        mcrdl on a communicator of one rank, where MPI finishes at issue: the engine alone.
        Time spent in Python's garbage collector is measured apart and reported as its mean
        cost per operation (its full collections scan every live object of the process,
        torch's included, and run in some batches only).
        """
        bufs = [torch.zeros(1) for _ in range(count)]
        arrays = [b.numpy() for b in bufs]
        c = self.raw_mpi
        MPI = self.MPI
        alone = self.alone

        def raw() -> None:
            reqs = [c.Iallreduce(MPI.IN_PLACE, a) for a in arrays]
            MPI.Request.Waitall(reqs)

        def ours(comm: mcrdl.Communicator) -> None:
            futs = [comm.allreduce(b, backend="mpi") for b in bufs]
            for f in futs:
                f.wait()

        out = {}
        for name, fn in (("raw", raw), ("mcrdl", lambda: ours(self.comm)),
                         ("engine", lambda: ours(alone))):
            self.sync()
            fn()
            without_gc, gc_share = [], []
            for _ in range(reps):
                self.sync()
                self.gc_time = 0.0
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                without_gc.append((dt - self.gc_time) / count)
                gc_share.append(self.gc_time / count)
            # The collector's cost is amortized (a mean): a full collection runs in some
            # batches only, and a median over batches would drop it whenever that is fewer
            # than half of them.
            out[name + "_nogc"] = self.slowest(statistics.median(without_gc))
            out[name + "_gc"] = self.slowest(statistics.fmean(gc_share))
            out[name] = out[name + "_nogc"] + out[name + "_gc"]
        return out

    def _gc_watch(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_time += time.perf_counter() - self._gc_t0


def mpi_verdict(nbytes: int, r: dict[str, float]) -> str:
    """The targets of mcrdl over mpi, `.wait()` (and `await` at <= 4 KiB) against raw nb:
    <= 4 KiB: + 4 µs (await + 6 µs); 16 KiB-256 KiB: + 5 µs; >= 1 MiB: 0.9x; >= 4 MiB: 0.95x."""
    ok = meets_mpi_target(nbytes, r["nb"], r["wait"])
    if nbytes <= 4096:
        ok = ok and (r["await"] - r["await_nb"]) * 1e6 <= 6
    return "ok" if ok else "MISS"


def gloo_verdict(r: dict[str, float]) -> str:
    """gloo `.wait()` within 1.1x raw gloo, the A/A noise of the same run allowed for."""
    return "ok" if r["ratio"] <= 1.1 * max(1.0, r["aa"]) else "MISS"


def latency_table(bench: Bench, sizes: list[int], ops: list[str], scale: float,
                  modes: list[bool], gloo: bool) -> list[dict]:
    rows = []
    for op in ops:
        for nbytes in sizes:
            r: dict = {"op": op, "bytes": nbytes, "floor": bench.floor_point(op, nbytes, scale)}
            for barrier in modes:
                point = bench.mpi_point(op, nbytes, scale, barrier)
                point["verdict"] = mpi_verdict(nbytes, point)
                r["barrier" if barrier else "free"] = point
            if gloo:
                point = bench.gloo_point(op, nbytes, scale)
                point["verdict"] = gloo_verdict(point)
                r["gloo"] = point
            rows.append(r)
            if bench.comm.rank == 0:
                print(format_row(r, modes, gloo), flush=True)
    return rows


def header(modes: list[bool], gloo: bool) -> str:
    mpi = (f" {'raw nb':>8} {'raw blk':>8} {'wait':>8} {'+µs':>6} {'nb/wait':>7}"
           f" {'await':>8} {'+µs':>6} {'target':>6}")
    names = {False: "back to back", True: "barrier before each call"}
    top = f"{'':<14} {'':>7} {'floor':>6} |" + "|".join(f" {names[m]:<{len(mpi) - 1}}" for m in modes)
    cols = f"{'op':<14} {'size':>7} {'+µs':>6} |" + "|".join(mpi for _ in modes)
    if gloo:
        top += f"| {'gloo':<46}"
        cols += (f"| {'raw':>8} {'wait':>8} {'ratio':>5} {'A/A':>5} {'await':>8} {'ratio':>5}"
                 f" {'target':>6}")
    return top + "\n" + cols


def format_row(r: dict, modes: list[bool], gloo: bool) -> str:
    us = 1e6
    floor = (r["floor"]["wait"] - r["floor"]["nb"]) * us
    line = f"{r['op']:<14} {human(r['bytes']):>7} {floor:+6.1f} |"
    cells = []
    for barrier in modes:
        m = r["barrier" if barrier else "free"]
        cells.append(f" {m['nb'] * us:8.1f} {m['blocking'] * us:8.1f} {m['wait'] * us:8.1f}"
                     f" {(m['wait'] - m['nb']) * us:+6.1f} {m['nb'] / m['wait']:7.3f}"
                     f" {m['await'] * us:8.1f} {(m['await'] - m['await_nb']) * us:+6.1f}"
                     f" {m['verdict']:>6}")
    line += "|".join(cells)
    if gloo:
        g = r["gloo"]
        line += (f"| {g['raw'] * us:8.1f} {g['wait'] * us:8.1f} {g['ratio']:5.2f} {g['aa']:5.2f}"
                 f" {g['await'] * us:8.1f} {g['await_ratio']:5.2f} {g['verdict']:>6}")
    return line


def summary(rows: list[dict], modes: list[bool]) -> None:
    """Per size class and mode: the range of mcrdl's excess over raw nb, targets met."""
    us = 1e6
    classes = (("<= 4K", lambda b: b <= 4096, "+µs"), ("16K-256K", lambda b: 4096 < b < 1 << 20, "+µs"),
               (">= 1M", lambda b: b >= 1 << 20, "nb/wait"))
    print("\n# summary of mcrdl over mpi, .wait() against raw nb")
    floors = [(r["floor"]["wait"] - r["floor"]["nb"]) * us for r in rows if r["bytes"] <= 4096]
    if floors:
        print(f"  floor        <= 4K     +{min(floors):.1f} to +{max(floors):.1f} µs: the engine"
              " alone, on a communicator of one rank (MPI finishes at issue)")
    for barrier in modes:
        mode = "barrier" if barrier else "free"
        for label, member, unit in classes:
            pts = [r for r in rows if member(r["bytes"])]
            if not pts:
                continue
            if unit == "+µs":
                vals = [(r[mode]["wait"] - r[mode]["nb"]) * us for r in pts]
                span = f"{min(vals):+.1f} to {max(vals):+.1f} µs (median {statistics.median(vals):+.1f})"
            else:
                vals = [r[mode]["nb"] / r[mode]["wait"] for r in pts]
                span = f"{min(vals):.2f} to {max(vals):.2f}x"
            met = sum(r[mode]["verdict"] == "ok" for r in pts)
            print(f"  {'barrier' if barrier else 'back to back':<12} {label:<9} {span}; "
                  f"targets met at {met} of {len(pts)} points")
    if "gloo" in rows[0]:
        ratios = [r["gloo"]["ratio"] for r in rows]
        met = sum(r["gloo"]["verdict"] == "ok" for r in rows)
        print(f"  gloo .wait()/raw {min(ratios):.2f} to {max(ratios):.2f}; within 1.1x (A/A"
              f" allowed for) at {met} of {len(rows)} points")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4:64M", help="lo:hi in bytes (powers of 4), e.g. 4:4K")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--section", choices=["latency", "inflight", "all"], default="latency")
    ap.add_argument("--barrier", choices=["both", "off", "on"], default="both",
                    help="MPI columns back to back, with a barrier before each call, or both")
    ap.add_argument("--no-gloo", action="store_true", help="leave out the gloo columns")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    ap.add_argument("--json", help="write the measurements here (rank 0)")
    args = ap.parse_args()
    comm = mcrdl.init()
    bench = Bench(comm)
    report: dict = {"ranks": comm.size, "cores": os.cpu_count(), "host": host()}
    modes = {"both": [False, True], "off": [False], "on": [True]}[args.barrier]
    if comm.rank == 0:
        print(f"# mcrdl {mcrdl.__version__} overhead, {comm.size} ranks, {report['host']};"
              " median µs of the slowest rank per call\n"
              "# floor +µs = mcrdl .wait() - raw nb on a communicator of one rank (the engine"
              " alone: MPI finishes at issue)\n"
              "# raw nb = mpi4py Ixxx + Test loop (the floor); raw blk = blocking call;"
              " +µs = mcrdl - raw nb timed in the same pairs; nb/wait = raw nb time / mcrdl's;"
              "\n# target: <= 4K +4 µs (await +6), 16K-256K +5 µs, >= 1M 0.9x, >= 4M 0.95x;"
              " gloo ratio = median of per-pair mcrdl/raw, A/A = raw gloo against itself,"
              " target 1.1x", flush=True)
    if args.section in ("latency", "all"):
        if comm.rank == 0:
            print(header(modes, not args.no_gloo), flush=True)
        report["latency"] = latency_table(bench, parse_sizes(args.sizes, base=4),
                                          args.ops.split(","), args.scale, modes,
                                          not args.no_gloo)
        if comm.rank == 0:
            summary(report["latency"], modes)
    if args.section in ("inflight", "all"):
        rows = []
        if comm.rank == 0:
            print(f"\n# µs per operation with N in flight: median without Python's garbage collector,"
                  f" plus gc = the collector's mean cost per operation"
                  f"\n# {'N':>6} | {'raw mpi':>8} | {'mcrdl':>8} {'gc':>6} | {'engine':>8} {'gc':>6}"
                  f" {'engine-gc':>9}")
        for count in (10, 100, 1000, 10000):
            r = bench.inflight_point(count, reps=max(8, int(2000 / count * args.scale)))
            r["count"] = count
            rows.append(r)
            if comm.rank == 0:
                print(f"  {count:>6} | {r['raw'] * 1e6:8.2f} | {r['mcrdl'] * 1e6:8.2f}"
                      f" {r['mcrdl_gc'] * 1e6:6.2f} | {r['engine'] * 1e6:8.2f}"
                      f" {r['engine_gc'] * 1e6:6.2f} {r['engine_nogc'] * 1e6:9.2f}",
                      flush=True)
        if comm.rank == 0:
            first, last = rows[0], rows[-1]
            print(f"  engine cost growth 10 -> 10,000 in flight: {last['engine'] / first['engine']:.2f}x"
                  f" ({last['engine_nogc'] / first['engine_nogc']:.2f}x"
                  " without garbage collection)")
        report["inflight"] = rows
    if args.json and comm.rank == 0:
        Path(args.json).write_text(json.dumps(report, indent=1))
    bench.dist.destroy_process_group()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
