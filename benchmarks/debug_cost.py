"""What debug mode (the fingerprint check before every collective) costs per operation.

    mpiexec -n 2 python benchmarks/debug_cost.py

Times allreduce and alltoall on each backend at a few sizes with debug mode off, then on
(two runtimes, one after the other), and prints the median per operation and the difference.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import human  # noqa: E402

import mcrdl  # noqa: E402

SIZES = (4, 4096, 1 << 20)
ITERS = {4: 1000, 4096: 500, 1 << 20: 50}


def measure(debug: bool) -> dict[tuple[str, str, int], float]:
    comm = mcrdl.init(debug=debug)
    out = {}
    for backend in ("mpi", "gloo"):
        for op in ("allreduce", "alltoall"):
            for size in SIZES:
                n = max(comm.size, size // 4 // comm.size * comm.size)
                t = torch.zeros(n)
                call = getattr(comm, op)
                iters = ITERS[size] // (5 if backend == "gloo" else 1)
                for _ in range(10):
                    call(t, backend=backend).wait()
                comm.barrier(backend="mpi").wait()
                samples = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    call(t, backend=backend).wait()
                    samples.append(time.perf_counter() - t0)
                out[(backend, op, size)] = statistics.median(samples)
    rank = comm.rank
    mcrdl.finalize()
    return out if rank == 0 else {}


def main() -> None:
    off = measure(False)
    on = measure(True)
    if not off:
        return
    print("# debug mode cost per operation (median µs, rank 0, 2 ranks)")
    print(f"{'backend':<6} {'op':<10} {'size':>6} | {'off':>9} {'on':>9} {'+µs':>8} {'ratio':>6}")
    for key in off:
        backend, op, size = key
        a, b = off[key] * 1e6, on[key] * 1e6
        print(f"{backend:<6} {op:<10} {human(size):>6} | {a:9.1f} {b:9.1f} {b - a:+8.1f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
