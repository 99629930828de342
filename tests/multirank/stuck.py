"""Ill-formed programs for ``python -m mcrdl trace explain`` (tests/test_multirank.py).

    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 3 python stuck.py skip
    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 2 python stuck.py cycle

``skip`` (3 ranks): ranks 0 and 2 allreduce on the world; rank 1 skips it and waits instead
for an allreduce on the communicator it shares with rank 0, which rank 0 never issues.
``cycle`` (2 ranks): two communicators over both ranks; rank 0 blocks on an allreduce on
the first, rank 1 on one on the second. Each rank writes ``$MCRDL_RESULT_DIR/stuck<R>``
before it blocks; the test signals SIGUSR2 (a dump) while they are stuck, and the timeout
ends them.
"""

import os
import sys

import torch

import mcrdl

comm = mcrdl.init()
mode = sys.argv[1]
if mode == "skip":
    pair = comm.split(0 if comm.rank < 2 else 1)  # ranks 0 and 1; rank 2 alone
    first, second = (pair, comm) if comm.rank == 1 else (comm, pair)
else:
    a, b = comm.split(0), comm.split(0)
    first = a if comm.rank == 0 else b
comm.allreduce(torch.ones(4), backend="mpi").wait()
open(os.path.join(os.environ["MCRDL_RESULT_DIR"], f"stuck{comm.rank}"), "w").close()
try:
    first.allreduce(torch.ones(4), backend="mpi").wait()
except mcrdl.MCRDLError as exc:
    print(f"rank {comm.rank}: {type(exc).__name__}", flush=True)
mcrdl.finalize()
