"""What the comms log costs per operation: the same calls with the log off and on, alternated.

    mpiexec -n 2 python benchmarks/log_cost.py [--pairs 20000]

Times a 4-byte allreduce and alltoall over mpi with ``.wait()``, on the world and on a
communicator of one rank (where MPI finishes at issue, so the difference is the engine's
alone), switching the engine's log on and off call by call (``Engine.log``: a list, or
None). Prints the medians and the median of the per-pair differences (log on - off), in µs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import host  # noqa: E402

import mcrdl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20000)
    args = ap.parse_args()
    comm = mcrdl.init()
    engine = comm.runtime.engine
    alone = comm.split(comm.rank)
    t = torch.zeros(1)
    calls = {
        ("allreduce", "world"): lambda: comm.allreduce(t, backend="mpi").wait(),
        ("alltoall", "world"): lambda: comm.alltoall(t.repeat(comm.size), backend="mpi").wait(),
        ("allreduce", "one rank"): lambda: alone.allreduce(t, backend="mpi").wait(),
        ("alltoall", "one rank"): lambda: alone.alltoall(t, backend="mpi").wait(),
    }
    if comm.rank == 0:
        print(f"# comms log cost, {comm.size} ranks, {host()}; µs per call, medians of"
              f" {args.pairs} alternated pairs\n{'op':<10} {'comm':<9} {'off':>7} {'on':>7}"
              f" {'on-off':>7}")
    clock = time.perf_counter
    for (op, where), call in calls.items():
        for _ in range(200):
            call()
        off, on, diff = [], [], []
        comm.barrier(backend="mpi").wait()
        for i in range(args.pairs):
            pair = []
            for log in ((None, []) if i % 2 == 0 else ([], None)):
                engine.log = log
                t0 = clock()
                call()
                pair.append((log is not None, clock() - t0))
            d = dict(pair)
            off.append(d[False])
            on.append(d[True])
            diff.append(d[True] - d[False])
        engine.log = None
        if comm.rank == 0:
            print(f"{op:<10} {where:<9} {statistics.median(off) * 1e6:7.2f}"
                  f" {statistics.median(on) * 1e6:7.2f} {statistics.median(diff) * 1e6:+7.2f}",
                  flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
