"""``python -m mcrdl`` (or ``info``): versions, and which MPI library was loaded;
``python -m mcrdl bench`` and ``python -m mcrdl tune`` (under mpiexec or torchrun), and
``python -m mcrdl trace`` (anywhere: it reads a trace written with ``MCRDL_TRACE``), and
``python -m mcrdl run`` (N ranks on this host; a rank that dies leaves the others running).

    mpiexec -n 2 python -m mcrdl bench --ops allreduce,alltoall --sizes 4:64M --plot bench.png
    mpiexec -n 2 python -m mcrdl bench --format osu --ops allreduce --sizes 4:1M
    mpiexec -n 2 python -m mcrdl tune --output tuning.json
    MCRDL_TUNING=tuning.json mpiexec -n 2 python train.py      # backend="auto" uses it
    MCRDL_TRACE=trace.json mpiexec -n 2 python train.py        # a timeline at finalize
    python -m mcrdl trace summary trace.json
    python -m mcrdl trace plot trace.json -o timeline.png
    MCRDL_FLIGHT_RECORDER=fr-{rank}.json mpiexec -n 4 python train.py   # dumps, machine-readable
    python -m mcrdl trace explain fr-*.json                    # which operation is stuck, why
    python -m mcrdl run -n 4 train.py                          # no rank ends the others
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import socket
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _bytes(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4, 64K or 16M") from None


def sizes_arg(spec: str, factor: int) -> list[int]:
    """``4:64M`` (powers of ``factor`` from 4 B to 64 MiB) or a list ``1K,1M``."""
    if "," in spec:
        return [_bytes(s) for s in spec.split(",")]
    lo, _, hi = spec.partition(":")
    a, b = _bytes(lo), _bytes(hi or lo)
    if a <= 0 or b < a:
        raise argparse.ArgumentTypeError(f"--sizes {spec!r}: need 0 < lo <= hi")
    out = []
    while a <= b:
        out.append(a)
        a *= factor
    return out


def _parser() -> argparse.ArgumentParser:
    from .tuning._bench import OPS

    p = argparse.ArgumentParser(prog="python -m mcrdl", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    sub.add_parser("info", help="versions, and which MPI library mpi4py loaded (the default)")
    for name, helptext in (("bench", "measure operations on every backend"),
                           ("tune", "measure, then write a tuning table for backend='auto'")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--ops", default=",".join(o for o in OPS if o != "barrier"),
                       help=f"comma-separated, from: {', '.join(OPS)}")
        s.add_argument("--sizes", default="4:64M", help="lo:hi (powers of --factor) or a list")
        s.add_argument("--factor", type=int, default=4, choices=(2, 4))
        s.add_argument("--dtypes", default="float32" if name == "bench"
                       else "float32,bfloat16,float16,int64")
        s.add_argument("--backends", default=None,
                       help="comma-separated (default: every backend up, plus auto for bench)")
        s.add_argument("--budget", type=float, default=0.1,
                       help="seconds of timed iterations per point (after warm-up)")
        s.add_argument("--warmup", type=int, default=5)
        s.add_argument("--device", default="cpu",
                       help="where the buffers are: cpu, cuda (the current GPU), or both "
                            "(cpu,cuda)")
        s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="a progress bar on rank 0 (default: only when its stderr is a "
                            "terminal, which under mpiexec it is not: --progress shows it)")
        if name == "bench":
            s.add_argument("--format", choices=("table", "osu", "csv", "json"), default="table")
            s.add_argument("--output", help="write the report here instead of stdout")
            s.add_argument("--plot", help="also write a PNG plot of latency and busbw")
            s.add_argument("--no-raw", action="store_true",
                           help="leave out raw mpi4py and raw torch.distributed")
        else:
            s.add_argument("--output", default="mcrdl-tuning.json")
    r = sub.add_parser("run", help="start N ranks on this host; a rank that dies leaves the "
                                   "others running (torchrun's environment, the store here)")
    r.add_argument("-n", "--nproc", type=int, required=True, help="how many ranks")
    r.add_argument("--host", default="127.0.0.1",
                   help="the address the ranks reach the store at (default: loopback)")
    r.add_argument("argv", nargs=argparse.REMAINDER, metavar="command",
                   help="what python runs in each rank: script.py [args...], or -- -m module")
    t = sub.add_parser("trace", help="read a trace (MCRDL_TRACE) or flight-recorder dumps")
    t.add_argument("action", choices=("summary", "plot", "explain"))
    t.add_argument("path", nargs="+",
                   help="the trace (JSON); for explain, every rank's dump (JSON lines)")
    t.add_argument("-o", "--output", default="timeline.png", help="plot: the PNG to write")
    t.add_argument("--window", metavar="START:END",
                   help="plot: only this stretch, in ms from the first slice (e.g. 500:650)")
    return p


def _trace(args: Any) -> int:
    import json

    from .observe._recorder import plot_trace, summarize_trace

    if args.action == "explain":
        from .observe._explain import explain, load_dumps

        try:
            dumps = load_dumps(args.path)
        except (OSError, ValueError) as exc:
            print(f"cannot read the dumps: {exc}", file=sys.stderr)
            return 2
        print(explain(dumps))
        return 0
    if len(args.path) != 1:
        print(f"trace {args.action} reads one trace, got {len(args.path)} files",
              file=sys.stderr)
        return 2
    args.path = args.path[0]
    try:
        with open(args.path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        print(f"cannot read the trace {args.path!r}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        print(f"{args.path!r} is not a trace-event file (no traceEvents)", file=sys.stderr)
        return 2
    if args.action == "summary":
        print(summarize_trace(doc))
        return 0
    window = None
    if args.window:
        try:
            start, end = (float(x) for x in args.window.split(":"))
        except ValueError:
            print(f"--window {args.window!r}: give START:END in ms, e.g. 500:650",
                  file=sys.stderr)
            return 2
        window = (start, end)
    try:
        plot_trace(doc, args.output, f"mcrdl timeline: {os.path.basename(args.path)}", window)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def provenance(comm: Any) -> dict[str, Any]:
    """Where and with what a measurement was made."""
    import numpy as np
    import torch

    import mcrdl

    info: dict[str, Any] = {
        "mcrdl": mcrdl.__version__, "torch": torch.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "world_size": comm.size,
        "backends": list(comm.backends),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if "mpi" in comm.backends:
        import mpi4py
        from mpi4py import MPI

        info["mpi4py"] = mpi4py.__version__
        info["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
        mpi = comm.runtime.backend("mpi")
        info["mpi_memory_kinds"] = list(getattr(mpi, "memory_kinds", ()))
        info["mpi_cuda_support"] = getattr(mpi, "cuda_support", None)
    hosts = sorted({socket.gethostname()})
    cpu = platform.processor() or platform.machine()
    info["host"] = hashlib.sha256(f"{hosts}|{cpu}|{os.cpu_count()}".encode()).hexdigest()[:16]
    return info


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    args = _parser().parse_args(argv)
    if args.command in (None, "info"):
        print(info())
        return 0
    if args.command == "trace":
        return _trace(args)
    if args.command == "run":
        from .bootstrap._run import run

        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return run(args.nproc, argv, args.host)
    import mcrdl
    from mcrdl.tuning._bench import sweep

    comm = mcrdl.init()
    try:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        sizes = sizes_arg(args.sizes, args.factor)
        names: list[str | None] = (list(comm.backends) if not args.backends
                                   else [b.strip() for b in args.backends.split(",")])
        if args.command == "bench" and not args.backends:
            names.append(None)  # auto
        points = []
        for device in (d.strip() for d in args.device.split(",") if d.strip()):
            try:
                points += sweep(comm, ops, sizes, dtypes, names,
                                raw=args.command == "bench" and not args.no_raw,
                                warmup=args.warmup, budget=args.budget,
                                progress=args.progress, device=device)
            except ValueError as exc:  # (every rank finds the same)
                if comm.rank == 0:
                    print(f"--device {args.device}: {exc}", file=sys.stderr)
                return 2
        if comm.rank != 0:
            return 0
        meta = provenance(comm)
        if args.command == "tune":
            return _write_table(points, meta, args.output)
        return _report(points, meta, args, comm.size)
    finally:
        mcrdl.finalize()


def info() -> str:
    """What ``python -m mcrdl`` prints: mcrdl's, torch's and mpi4py's versions, and the MPI
    library mpi4py loaded (a site's MPI, or the ``mpich`` wheel's), without starting MPI."""
    import mpi4py
    import torch

    import mcrdl
    from mcrdl.core._versions import TORCH_TESTED, torch_in_range

    mpi4py.rc.initialize = False  # (MPI_Get_library_version needs no MPI_Init)
    from mpi4py import MPI

    (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_TESTED
    tested = "within" if torch_in_range(torch.__version__) else "OUTSIDE"
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    except OSError:
        paths = []
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    return "\n".join([
        f"mcrdl {mcrdl.__version__}",
        f"torch {torch.__version__} ({tested} the range mcrdl has been run with, "
        f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor})",
        f"mpi4py {mpi4py.__version__}, MPI {MPI.Get_version()[0]}.{MPI.Get_version()[1]}: "
        f"{library}",
        f"MPI library loaded from: {', '.join(paths) or 'unknown'}",
    ])


def _report(points: Any, meta: dict[str, Any], args: Any, ranks: int) -> int:
    from .tuning import _report as report

    text = {"table": lambda: report.as_table(points, ranks), "osu": lambda: report.as_osu(points),
            "csv": lambda: report.as_csv(points),
            "json": lambda: report.as_json(points, meta)}[args.format]()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    if args.plot:
        report.plot(points, args.plot, f"mcrdl bench, {ranks} ranks")
    return 0


def _write_table(points: Any, meta: dict[str, Any], path: str) -> int:
    from .tuning import TuningTable

    by_device: dict[str, dict[tuple[str, str, int, int], dict[str, float]]] = {}
    for p in points:
        by_device.setdefault(p.device, {}).setdefault(
            (p.op, p.dtype if p.op != "barrier" else "none", meta["world_size"], p.nbytes),
            {})[p.backend] = p.time_us
    tables = [TuningTable.from_measurements(latencies, meta, device=device)
              for device, latencies in by_device.items()]
    table = TuningTable([e for t in tables for e in t.entries], meta)
    table.save(path)
    print(f"wrote {path}: {len(table.entries)} ranges over {len(points)} measurements, "
          f"hash {table.hash[:12]}")
    for e in table.entries:
        hi = "inf" if e.max_bytes is None else e.max_bytes
        on = "" if e.device == "cpu" else f" on {e.device}"
        print(f"  {e.op:<15} {e.dtype:<9}{on} n={e.comm_size} [{e.min_bytes}, {hi}) -> "
              f"{e.backend} (margin {e.margin:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
