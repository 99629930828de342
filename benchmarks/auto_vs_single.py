"""backend="auto" against every single backend and against torch.distributed, in one run.

    mpiexec -n 2 python benchmarks/auto_vs_single.py --plot auto2.png
    mpiexec -n 4 python benchmarks/auto_vs_single.py --sizes 4:4M

First it tunes (the same sweep as ``python -m mcrdl tune``) and writes the table; then it
brings the runtime up again with that table and times, for every operation and size, auto
against each backend alone and against raw torch.distributed (gloo), one candidate at a time,
alternating with auto call by call so that both see the same machine. It prints auto / best
single backend and auto / torch.distributed per point, and what consulting the table costs
per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mcrdl  # noqa: E402
from common import alternate, human, parse_sizes  # noqa: E402
from mcrdl import DType, OpKind, ReduceOp  # noqa: E402
from mcrdl.tuning import TuningTable  # noqa: E402
from mcrdl.tuning._bench import _elements, _global_bytes, _mcrdl_call, _out_elements, _Raw, sweep  # noqa: E402

OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")


def tune(path: str, ops: list[str], sizes: list[int], budget: float) -> None:
    comm = mcrdl.init()
    points = sweep(comm, ops, sizes, ["float32"], list(comm.backends), raw=False,
                   budget=budget)
    if comm.rank == 0:
        lat: dict = {}
        for p in points:
            lat.setdefault((p.op, p.dtype, comm.size, p.nbytes), {})[p.backend] = p.time_us
        TuningTable.from_measurements(lat, {"world_size": comm.size, "by": __file__}).save(path)
    mcrdl.finalize()


def paired(comm, call_a, call_b, cycles: int) -> tuple[float, float]:
    """Seconds per call of two candidates timed alternately (median, slowest rank).

    Timing every candidate in one random round robin was rejected: a fast backend's calls
    then paid for whichever slow gloo call preceded them on the other rank, which spread
    auto/mpi (the same code path) from 0.76 to 1.14 at small sizes.
    """
    control = comm.runtime.control_backend
    call_a()
    call_b()
    comm.barrier(backend=control).wait()
    a, b = alternate(call_a, call_b, cycles)
    med = np.array([statistics.median(a), statistics.median(b)])
    comm.allreduce(med, ReduceOp.MAX, backend=control).wait()
    return float(med[0]), float(med[1])


def measure(comm, calls: dict, cycles: int) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per call of each candidate, auto's time over it), each from its pair with auto.

    Auto's own time is the one from its pair with the fastest single backend.
    """
    times: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for name, call in calls.items():
        if name != "auto":
            t_auto, times[name] = paired(comm, calls["auto"], call, cycles)
            ratios[name] = t_auto / times[name]
    best = min(comm.backends, key=times.__getitem__)
    times["auto"] = ratios[best] * times[best]
    return times, ratios


def over_best(run: tuple[dict[str, float], dict[str, float]], backends) -> float:
    """auto / the fastest single backend, in one ``measure`` run."""
    times, ratios = run
    return ratios[min(backends, key=times.__getitem__)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4:16M")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--table", default="auto-vs-single-tuning.json")
    ap.add_argument("--budget", type=float, default=0.1, help="tuning seconds per point")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--plot", help="write a PNG of auto/best and auto/torch per op")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the cycles per point")
    args = ap.parse_args()
    ops = args.ops.split(",")
    sizes = parse_sizes(args.sizes, base=4)
    tune(args.table, ops, sizes, args.budget)
    comm = mcrdl.init(tuning=args.table)
    n = comm.size
    raw = _Raw(comm)
    rows = []
    if comm.rank == 0:
        print(f"# auto vs single backends, {n} ranks; table {args.table} "
              f"(hash {comm.runtime.tuning.hash[:12]}); median µs of the slowest rank")
        print(f"{'op':<15} {'size':>6} | {'auto':>9} {'mpi':>9} {'gloo':>9} {'torch':>9} |"
              f" {'chose':>5} {'auto/best':>9} {'auto/torch':>10}")
    for op in ops:
        for size in sizes:
            elems = _elements(op, size, 4, n)
            t = torch.zeros(elems)
            out = torch.zeros(_out_elements(op, elems, n))
            calls = {b: _mcrdl_call(comm, op, t, out, ReduceOp.SUM, b if b != "auto" else None)
                     for b in ("auto", *comm.backends)}
            torch_call = raw.torch_call(op, t, out, ReduceOp.SUM)
            if torch_call is not None:
                calls["torch"] = torch_call
            cycles = max(8, int((400 if size <= 4096 else 100 if size <= (1 << 20) else 40)
                                * args.scale))
            # This machine's noise can exceed 3% at a point: re-measure a point whose auto/best
            # ratio falls outside [0.97, 1.03] up to four more times and keep the median run (by
            # ratio), never the best one.
            runs = [measure(comm, calls, cycles)]
            while len(runs) < 5 and not 0.97 <= over_best(runs[-1], comm.backends) <= 1.03:
                runs.append(measure(comm, calls, cycles))
            run = sorted(runs, key=lambda r: over_best(r, comm.backends))[len(runs) // 2]
            times, ratios = run
            nbytes = _global_bytes(op, elems, 4, n)
            chose = comm.runtime.tuning.lookup(op, "float32", n, nbytes)
            row = {"op": op, "bytes": nbytes, **{k: v * 1e6 for k, v in times.items()},
                   "chose": chose, "auto_over_best": over_best(run, comm.backends),
                   "auto_over_torch": ratios.get("torch")}
            rows.append(row)
            if comm.rank == 0:
                print(f"{op:<15} {human(nbytes):>6} | {row['auto']:9.1f} {row.get('mpi', 0):9.1f}"
                      f" {row.get('gloo', 0):9.1f} {row.get('torch', 0):9.1f} | {chose:>5}"
                      f" {row['auto_over_best']:9.3f} {row['auto_over_torch'] or 0:10.4f}",
                      flush=True)
    # What consulting the table costs per call: the table as tuned, and a table that splits
    # allreduce by size (a Router: one bisect per call).
    def per_call(backend):
        comm._choose(OpKind.ALLREDUCE, DType.FLOAT32, ReduceOp.SUM, 16, backend)
        return min(timeit.repeat(
            lambda: comm._choose(OpKind.ALLREDUCE, DType.FLOAT32, ReduceOp.SUM, 16, backend),
            number=100000, repeat=5)) / 100000 * 1e9

    cost = {"tuned": per_call(None), "explicit": per_call("mpi")}
    from mcrdl.tuning import Entry

    tuned = comm._selector.table
    comm._selector.table = TuningTable([Entry("allreduce", "float32", n, 0, 1024, "mpi"),
                                        Entry("allreduce", "float32", n, 1024, None, "gloo")])
    comm._choice_cache.clear()
    cost["sized"] = per_call(None)
    comm._selector.table = tuned
    comm._choice_cache.clear()
    if comm.rank == 0:
        worst = max(rows, key=lambda r: r["auto_over_best"])
        print(f"# worst auto/best: {worst['auto_over_best']:.3f} ({worst['op']} "
              f"{human(worst['bytes'])}); points over 1.03: "
              f"{sum(r['auto_over_best'] > 1.03 for r in rows)} of {len(rows)}")
        print(f"# choosing a backend per call: auto with the tuned table {cost['tuned']:.0f} ns,"
              f" auto with a size-split table {cost['sized']:.0f} ns, explicit name "
              f"{cost['explicit']:.0f} ns")
        if args.json:
            Path(args.json).write_text(json.dumps({"ranks": n, "rows": rows, "choose_ns": cost},
                                                  indent=1))
        if args.plot:
            plot(rows, args.plot, n)
    mcrdl.finalize()


def plot(rows: list[dict], path: str, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for op in sorted({r["op"] for r in rows}):
        mine = [r for r in rows if r["op"] == op]
        xs = [r["bytes"] for r in mine]
        axes[0].plot(xs, [r["auto_over_best"] for r in mine], marker="o", ms=3, label=op)
        axes[1].plot(xs, [r["auto_over_torch"] for r in mine], marker="o", ms=3, label=op)
    axes[0].axhline(1.03, color="red", lw=0.8, ls="--", label="1.03")
    axes[0].set_title(f"auto / best single backend ({n} ranks)")
    axes[1].set_title(f"auto / torch.distributed gloo ({n} ranks)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
