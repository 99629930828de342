"""A small operation's cost after the caches were filled with other data, mcrdl against raw.

    mpiexec -n 2 python benchmarks/cold_cache.py [--op alltoall] [--bytes 4K] [--iters 2000]

Before each call, every rank copies ``P`` bytes between two buffers of its own (as the
previous large operation, or the compute between two steps, would have touched them), then
both ranks meet in a barrier; then one ``--bytes`` operation is timed: mcrdl's
``.wait()`` over MPI, and raw mpi4py's nonblocking call with its ``Test`` loop, in
alternating pairs. Printed: the median of the slowest rank per ``P``, and mcrdl's excess.

Why: mcrdl's cost over raw MPI grows with the message size between 4 KiB and 1 MiB
(issue "overhead at every message size") although nothing of the message is copied in
Python. An operation that moves M bytes evicts the interpreter's working set from the
per-core caches (L2 here: 1 MiB), and the Python that runs around the MPI calls then misses
in them; the raw path runs far less Python. This isolates that effect from the message size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import human, parse_bytes  # noqa: E402

import mcrdl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="alltoall", choices=["alltoall", "allreduce", "allgather"])
    ap.add_argument("--bytes", default="4K")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--pollute", default="0,64K,256K,1M,4M,16M")
    args = ap.parse_args()
    torch.set_num_threads(1)
    comm = mcrdl.init()
    from mpi4py import MPI

    raw_comm = MPI.COMM_WORLD.Dup()
    n = parse_bytes(args.bytes) // 4
    t = torch.ones(n)
    o = torch.empty(n * (comm.size if args.op == "allgather" else 1))
    tn, on = t.numpy(), o.numpy()
    raw_start = {"alltoall": lambda: raw_comm.Ialltoall(tn, on),
                 "allreduce": lambda: raw_comm.Iallreduce(MPI.IN_PLACE, tn, MPI.SUM),
                 "allgather": lambda: raw_comm.Iallgather(tn, on)}[args.op]
    ours = {"alltoall": lambda: comm.alltoall(t, out=o, backend="mpi").wait(),
            "allreduce": lambda: comm.allreduce(t, backend="mpi").wait(),
            "allgather": lambda: comm.allgather(t, out=o, backend="mpi").wait()}[args.op]

    def raw() -> None:
        req = raw_start()
        while not req.Test():
            pass

    sizes = [parse_bytes(s) for s in args.pollute.split(",")]
    big = max(sizes) // 4
    src, dst = torch.ones(max(big, 1)), torch.empty(max(big, 1))
    if comm.rank == 0:
        print(f"# {args.op} of {human(n * 4)}, {comm.size} ranks, after copying P bytes; "
              f"median µs of the slowest rank over {args.iters} alternating pairs")
        print(f"{'P':>6} {'raw nb':>8} {'mcrdl':>8} {'excess':>8}")
    for p in sizes:
        k = p // 4
        times: dict[str, list[float]] = {"raw": [], "mcrdl": []}
        for i in range(args.iters):
            for name, call in (("raw", raw), ("mcrdl", ours)) if i % 2 else (
                    ("mcrdl", ours), ("raw", raw)):
                if k:
                    dst[:k].copy_(src[:k])
                raw_comm.Barrier()
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        med = torch.tensor([statistics.median(times["raw"]), statistics.median(times["mcrdl"])],
                           dtype=torch.float64)
        raw_comm.Allreduce(MPI.IN_PLACE, med.numpy(), MPI.MAX)
        if comm.rank == 0:
            r, m = med.tolist()
            print(f"{human(p) if p else '0':>6} {r * 1e6:8.1f} {m * 1e6:8.1f} {(m - r) * 1e6:+8.1f}")
    raw_comm.Free()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
