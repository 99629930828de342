"""A burst of collectives submitted together, then waited for: raw MPI both ways against mcrdl.

    mpiexec -n 2 python benchmarks/burst.py [--sizes 4,64K,1M,4M] [--count 64]

The shape of a training step that allreduces its gradient buckets as backward produces them
and waits before the optimizer. Per operation, median over steps (rank 0):

- ``raw together``: ``count`` mpi4py ``Iallreduce`` calls, then ``Waitall``;
- ``raw one by one``: ``Iallreduce`` then ``Wait``, ``count`` times;
- ``mcrdl``: ``count`` ``comm.allreduce(..., backend="mpi")`` calls, then ``wait()`` on each
  (the engine issues one collective per MPI communicator at a time, the next when one
  finishes: ``Capabilities.issue_window``).

Prints the ratio of mcrdl to the faster raw way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import human, parse_sizes, timed  # noqa: E402

import mcrdl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,64K,1M,4M")
    parser.add_argument("--count", type=int, default=64)
    args = parser.parse_args()
    comm = mcrdl.init()
    from mpi4py import MPI

    raw = MPI.COMM_WORLD.Dup()
    k = args.count
    rows = []
    for size in parse_sizes(args.sizes):
        bufs = [torch.zeros(max(1, size // 4)) for _ in range(k)]
        arrays = [b.numpy() for b in bufs]

        def together() -> None:
            MPI.Request.Waitall([raw.Iallreduce(MPI.IN_PLACE, a) for a in arrays])

        def one_by_one() -> None:
            for a in arrays:
                raw.Iallreduce(MPI.IN_PLACE, a).Wait()

        def ours() -> None:
            for fut in [comm.allreduce(b, backend="mpi") for b in bufs]:
                fut.wait()

        steps = max(5, min(200, (256 << 20) // max(1, size * k * 4)))
        medians = []
        for fn in (together, one_by_one, ours):
            fn()
            medians.append(statistics.median(timed(fn, steps, raw.Barrier)) / k)
        rows.append((size, *medians))
    rank = comm.rank
    raw.Free()
    mcrdl.finalize()
    if rank:
        return
    print(f"# {k} allreduces submitted together, then waited for; µs per operation, rank 0")
    print(f"{'size':>6} | {'raw together':>12} {'raw one by one':>14} | {'mcrdl':>8} "
          f"{'/ best raw':>10}")
    for size, a, b, c in rows:
        print(f"{human(size):>6} | {a * 1e6:12.2f} {b * 1e6:14.2f} | {c * 1e6:8.2f} "
              f"{c / min(a, b):10.2f}")


if __name__ == "__main__":
    main()
