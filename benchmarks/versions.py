"""Two versions of mcrdl in one run: this checkout's against another's, call by call.

    git worktree add /tmp/before <commit>
    mpiexec -n 2 python benchmarks/versions.py --other /tmp/before
    mpiexec -n 2 python benchmarks/versions.py --other . --other-debug --backend gloo

Both runtimes come up side by side in every rank (the other checkout's package is imported
under another name), and each operation is timed on both in alternating pairs
(``common.alternate``), so that the machine's drift -- this host's cells move by 2x between
minutes -- falls on both alike. Per call, the slowest rank's time counts (the time the
operation took for the job); printed are the medians of each version and the median of the
per-pair differences, in µs, with the raw blocking MPI call of the same size for scale.
``--other-debug`` brings the other runtime up in debug mode (with ``--other .``: what debug
mode's check of every collective costs, against the same code without it).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mcrdl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, human, parse_sizes  # noqa: E402

OPS = ("allreduce", "alltoall", "allgather", "broadcast", "sendrecv")


def load_other(root: str) -> Any:
    """The package ``mcrdl`` of the checkout at ``root``, imported as ``mcrdl_other``."""
    pkg = Path(root) / "mcrdl"
    spec = importlib.util.spec_from_file_location("mcrdl_other", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"no mcrdl package under {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mcrdl_other"] = module
    spec.loader.exec_module(module)
    registry = importlib.import_module("mcrdl_other.backends._registry")
    for name, entry in list(registry._ENTRIES.items()):  # its backends, not ours
        registry._ENTRIES[name] = entry.replace("mcrdl.", "mcrdl_other.", 1)
    return module


def call(comm: Any, op: str, x: torch.Tensor, out: torch.Tensor, backend: str) -> Any:
    if op == "allreduce":
        return lambda: comm.allreduce(x, backend=backend).wait()
    if op == "broadcast":
        return lambda: comm.broadcast(x, backend=backend).wait()
    if op == "alltoall":
        return lambda: comm.alltoall(x, out=out, backend=backend).wait()
    if op == "sendrecv":  # an exchange with the neighbour (rank ^ 1): a receive and a send
        peer = comm.rank ^ 1

        def exchange() -> None:
            r = comm.recv(out, peer, backend=backend)
            comm.send(x, peer, backend=backend).wait()
            r.wait()
        return exchange
    return lambda: comm.allgather(x, out=out, backend=backend).wait()


def slowest(times: list[float], world: Any) -> np.ndarray:
    """Per call, the slowest rank's seconds (on every rank)."""
    mine = np.asarray(times)
    table = np.empty((world.Get_size(), len(mine)))
    world.Allgather(mine, table)
    return table.max(axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="the other checkout's root")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", default="4,1K", help="global message sizes, e.g. 4,1K")
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--other-debug", action="store_true",
                        help="the other runtime in debug mode (init(debug=True))")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole comparison (the cells move between rounds)")
    parser.add_argument("--numpy", action="store_true",
                        help="pass numpy arrays (default: torch tensors)")
    args = parser.parse_args()
    other = load_other(args.other)
    new = mcrdl.init(backends=[args.backend])
    old = other.init(backends=[args.backend], debug=args.other_debug)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size = new.size
    if new.rank == 0:
        print(f"# {size} ranks, backend {args.backend}, "
              f"{'numpy arrays' if args.numpy else 'torch tensors'}, {args.pairs} pairs per "
              f"point; µs per call (slowest rank), medians")
        print(f"{'op':<10} {'size':>6} {'raw MPI':>8} {'other':>8} {'this':>8} "
              f"{'this-other':>11}")
    for _ in range(args.rounds):
        for op in args.ops.split(","):
            for nbytes in parse_sizes(args.sizes):
                n = max(size, nbytes // 4 // size * size) if op in ("alltoall",) else max(
                    1, nbytes // 4 // (size if op == "allgather" else 1))
                x = torch.ones(n)
                out = torch.empty(n * size if op == "allgather" else n)
                xs, outs = (x.numpy(), out.numpy()) if args.numpy else (x, out)
                a = call(new, op, xs, outs, args.backend)
                b = call(old, op, xs, outs, args.backend)
                for _ in range(200):  # warm both
                    a()
                    b()
                t_new, t_old = alternate(a, b, args.pairs)
                raw = _raw(op, x, out)
                t_raw, _ = alternate(raw, raw, max(1000, args.pairs // 10))
                s_new, s_old = slowest(t_new, world), slowest(t_old, world)
                s_raw = slowest(t_raw, world)
                if new.rank == 0:
                    diff = statistics.median((s_new - s_old).tolist())
                    print(f"{op:<10} {human(nbytes):>6} {np.median(s_raw) * 1e6:8.2f} "
                          f"{np.median(s_old) * 1e6:8.2f} {np.median(s_new) * 1e6:8.2f} "
                          f"{diff * 1e6:+11.2f}", flush=True)
    other.finalize()
    mcrdl.finalize()


def _raw(op: str, x: torch.Tensor, out: torch.Tensor) -> Any:
    from mpi4py import MPI

    comm = _RAW.setdefault("comm", MPI.COMM_WORLD.Dup())
    xs, os_ = x.numpy(), out.numpy()
    if op == "allreduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, xs)
    if op == "broadcast":
        return lambda: comm.Bcast(xs)
    if op == "alltoall":
        return lambda: comm.Alltoall(xs, os_)
    if op == "sendrecv":
        peer = comm.Get_rank() ^ 1
        return lambda: comm.Sendrecv(xs, peer, recvbuf=os_, source=peer)
    return lambda: comm.Allgather(xs, os_)


_RAW: dict[str, Any] = {}

if __name__ == "__main__":
    main()
