"""mcrdl's cost over the raw backends, measured side by side in one run.

    mpiexec -n 2 python benchmarks/overhead.py                 # latency table, 4 B .. 64 MiB
    mpiexec -n 4 python benchmarks/overhead.py --sizes 4:4K    # oversubscribed: 4 ranks, 2 cores
    mpiexec -n 2 python benchmarks/overhead.py --section inflight

For each operation and size it times, interleaved: raw mpi4py (blocking calls on the same
tensors' numpy views, and the nonblocking call with a ``Test`` loop: the floor of any
nonblocking engine), raw torch.distributed gloo (blocking), and mcrdl on each backend with
``.wait()`` and with ``await`` (uvloop). Calls are timed in alternating pairs; each cell is
the median over calls of the slowest rank's time (nccl-tests reports the slowest rank). The ``inflight`` section submits N independent operations before waiting
for any and reports the cost per operation as N grows from 10 to 10,000.
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

import mcrdl  # noqa: E402
from common import alternate, human, parse_sizes  # noqa: E402

OPS = ("allreduce", "alltoall", "allgather", "broadcast")


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
        }[op]

    def raw_mpi_nonblocking(self, op: str, t: torch.Tensor, out: torch.Tensor):
        a, o, c, IN_PLACE = t.numpy(), out.numpy(), self.raw_mpi, self.MPI.IN_PLACE
        start = {
            "allreduce": lambda: c.Iallreduce(IN_PLACE, a),
            "alltoall": lambda: c.Ialltoall(a, o),
            "allgather": lambda: c.Iallgather(a, o),
            "broadcast": lambda: c.Ibcast(a, 0),
        }[op]

        def call() -> None:
            req = start()
            while not req.Test():
                pass

        return call

    def raw_gloo_call(self, op: str, t: torch.Tensor, out: torch.Tensor):
        d = self.dist
        # all_gather_single where torch has it: its deprecated alias warns on every call.
        gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        return {
            "allreduce": lambda: d.all_reduce(t),
            "alltoall": lambda: d.all_to_all_single(out, t),
            "allgather": lambda: gather(out, t),
            "broadcast": lambda: d.broadcast(t, 0),
        }[op]

    def mcrdl_submit(self, op: str, t: torch.Tensor, out: torch.Tensor, backend: str):
        c = self.comm
        return {
            "allreduce": lambda: c.allreduce(t, backend=backend),
            "alltoall": lambda: c.alltoall(t, out=out, backend=backend),
            "allgather": lambda: c.allgather(t, out=out, backend=backend),
            "broadcast": lambda: c.broadcast(t, 0, backend=backend),
        }[op]

    def mcrdl_wait(self, op: str, t: torch.Tensor, out: torch.Tensor, backend: str):
        """Submit and wait in one call, as a training loop writes it (no extra frame)."""
        c = self.comm
        return {
            "allreduce": lambda: c.allreduce(t, backend=backend).wait(),
            "alltoall": lambda: c.alltoall(t, out=out, backend=backend).wait(),
            "allgather": lambda: c.allgather(t, out=out, backend=backend).wait(),
            "broadcast": lambda: c.broadcast(t, 0, backend=backend).wait(),
        }[op]

    # -- timing ------------------------------------------------------------------------

    def time_pair(self, call_a, call_b, iters: int) -> Pair:
        """Time two calls alternately, so that both see the same machine (it drifts here)."""
        self.sync()
        for _ in range(min(10, iters)):
            call_a()
            call_b()
        self.sync()
        a, b = alternate(call_a, call_b, iters)
        return self._pair(a, b, iters)

    def _pair(self, a: list[float], b: list[float], iters: int) -> Pair:
        mine = np.array([np.median(a), np.median(b)])
        self.raw_mpi.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MAX)
        per_call = np.array(a + b)
        self.raw_mpi.Allreduce(self.MPI.IN_PLACE, per_call, op=self.MPI.MAX)
        a_s, b_s = per_call[:iters], per_call[iters:]
        return Pair(float(np.median(a_s)), float(np.median(b_s)), float(np.median(b_s / a_s)),
                    float(mine[0]), float(mine[1]))

    def time_pair_async(self, call_a, submit_b, iters: int) -> Pair:
        """``time_pair`` with B awaited (``await submit_b()``) inside a running event loop
        (uvloop when installed); A, a plain blocking call, runs in the same loop."""

        async def run() -> tuple[list[float], list[float]]:
            for _ in range(min(10, iters)):
                call_a()
                await submit_b()
            self.sync()
            a: list[float] = []
            b: list[float] = []
            clock = time.perf_counter
            for i in range(iters):
                t0 = clock()
                if i % 2 == 0:
                    call_a()
                    t1 = clock()
                    await submit_b()
                    t2 = clock()
                    a.append(t1 - t0)
                    b.append(t2 - t1)
                else:
                    await submit_b()
                    t1 = clock()
                    call_a()
                    t2 = clock()
                    b.append(t1 - t0)
                    a.append(t2 - t1)
            return a, b

        self.sync()
        try:
            import uvloop

            a, b = uvloop.run(run())
        except ImportError:
            a, b = asyncio.run(run())
        return self._pair(a, b, iters)

    def latency_point(self, op: str, nbytes: int, scale: float) -> dict[str, float]:
        n = self.n
        elems = max(1, nbytes // 4)
        if op in ("alltoall",):
            elems = max(n, elems // n * n)
        t = torch.ones(elems, dtype=torch.float32)
        if op == "allreduce":
            t.zero_()  # sums of zeros stay finite however often they run
        out = torch.empty(elems * (n if op == "allgather" else 1), dtype=torch.float32)
        iters = iters_for(nbytes, scale)
        raw_mpi = self.raw_mpi_call(op, t, out)
        wait = self.time_pair(raw_mpi, self.mcrdl_wait(op, t, out, "mpi"), iters)
        nonblocking = self.time_pair(raw_mpi, self.raw_mpi_nonblocking(op, t, out), iters)
        awaited = self.time_pair_async(raw_mpi, self.mcrdl_submit(op, t, out, "mpi"), iters)
        # gloo's ratios need more pairs than MPI's at large sizes: its times spread more here.
        giters = max(3, iters // 4) if nbytes <= 4096 else max(iters, int(40 * scale))
        raw_gloo = self.raw_gloo_call(op, t, out)
        gloo_wait = self.time_pair(raw_gloo, self.mcrdl_wait(op, t, out, "gloo"), giters)
        # The noise floor of that ratio: raw gloo timed against itself, the same way.
        gloo_aa = self.time_pair(raw_gloo, raw_gloo, giters)
        gloo_await = self.time_pair_async(raw_gloo, self.mcrdl_submit(op, t, out, "gloo"), giters)
        # Every figure is reduced over the ranks already (Pair): the same on every rank.
        return {
            "raw_mpi": wait.a, "mpi_wait": wait.b,
            "raw_mpi_rank": wait.a_rank, "mpi_wait_rank": wait.b_rank,
            "raw_mpi_nb": nonblocking.b, "mpi_await": awaited.b,
            "raw_gloo": gloo_wait.a, "gloo_wait": gloo_wait.b, "gloo_ratio": gloo_wait.ratio,
            "gloo_aa": gloo_aa.ratio, "gloo_await": gloo_await.b,
            "gloo_await_ratio": gloo_await.ratio,
        }

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


def latency_table(bench: Bench, sizes: list[int], ops: list[str], scale: float) -> list[dict]:
    rows = []
    for op in ops:
        for nbytes in sizes:
            r = bench.latency_point(op, nbytes, scale)
            r.update(op=op, bytes=nbytes)
            rows.append(r)
            if bench.comm.rank == 0:
                print(format_row(r), flush=True)
    return rows


HEADER = (f"{'op':<10} {'size':>7} | {'raw mpi':>9} {'raw nb':>9} {'wait':>9} {'+µs':>6} {'rank':>6} {'await':>9} {'+µs':>6}"
          f" {'bw ratio':>8} | {'raw gloo':>9} {'wait':>9} {'ratio':>6} {'A/A':>5} {'await':>9}"
          f" {'ratio':>6}")


def format_row(r: dict) -> str:
    us = 1e6
    bw = r["raw_mpi"] / r["mpi_wait"]
    return (f"{r['op']:<10} {human(r['bytes']):>7} | {r['raw_mpi'] * us:9.1f}"
            f" {r['raw_mpi_nb'] * us:9.1f} {r['mpi_wait'] * us:9.1f}"
            f" {(r['mpi_wait'] - r['raw_mpi']) * us:+6.1f}"
            f" {(r['mpi_wait_rank'] - r['raw_mpi_rank']) * us:+6.1f} {r['mpi_await'] * us:9.1f}"
            f" {(r['mpi_await'] - r['raw_mpi']) * us:+6.1f} {bw:8.3f} | {r['raw_gloo'] * us:9.1f}"
            f" {r['gloo_wait'] * us:9.1f} {r['gloo_ratio']:6.2f} {r['gloo_aa']:5.2f}"
            f" {r['gloo_await'] * us:9.1f} {r['gloo_await_ratio']:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4:64M", help="lo:hi in bytes (powers of 4), e.g. 4:4K")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--section", choices=["latency", "inflight", "all"], default="latency")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    ap.add_argument("--json", help="write the measurements here (rank 0)")
    args = ap.parse_args()
    comm = mcrdl.init()
    bench = Bench(comm)
    report: dict = {"ranks": comm.size, "cores": os.cpu_count()}
    if comm.rank == 0:
        print(f"# mcrdl {mcrdl.__version__} overhead, {comm.size} ranks, {os.cpu_count()} cores;"
              " median µs of the slowest rank; raw nb = Ixxx + Test loop; +µs = mcrdl - raw mpi;"
              " rank = the same from each rank's own medians, slowest rank (nccl-tests' way);"
              " bw ratio = raw/mcrdl time;\n# gloo ratio = median of per-pair mcrdl/raw; A/A = raw gloo"
              " timed against itself (the noise floor)")
    if args.section in ("latency", "all"):
        if comm.rank == 0:
            print(HEADER, flush=True)
        report["latency"] = latency_table(bench, parse_sizes(args.sizes, base=4),
                                          args.ops.split(","), args.scale)
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
