"""Ill-formed programs for ``python -m mcrdl trace explain`` (tests/test_multirank.py).

    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 3 python stuck.py skip
    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 2 python stuck.py cycle

``skip`` (3 ranks): ranks 0 and 2 allreduce on the world; rank 1 skips it and waits instead
for an allreduce on the communicator it shares with rank 0, which rank 0 never issues.
``cycle`` (2 ranks): two communicators over both ranks; rank 0 blocks on an allreduce on
the first, rank 1 on one on the second. Each rank writes ``$MCRDL_RESULT_DIR/stuck<R>``
before it blocks; the test signals SIGUSR2 (a dump) while they are stuck, and the timeout
ends them.

Before they get stuck, every communicator they get stuck on has run a gloo allreduce as well
as MPI ones, so that an operation's number on its communicator (``#seq``, counted over all
its backends) differs from its position on its MPI lane (what the peers match by), and the
test can tell which of the two the flight recorder and the report give.
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
    mixed = [pair] if comm.rank < 2 else []
else:
    a, b = comm.split(0), comm.split(0)
    first = a if comm.rank == 0 else b
    mixed = [a, b]
for c in [*mixed, comm]:
    c.allreduce(torch.ones(4), backend="gloo").wait()
comm.allreduce(torch.ones(4), backend="mpi").wait()
open(os.path.join(os.environ["MCRDL_RESULT_DIR"], f"stuck{comm.rank}"), "w").close()
try:
    first.allreduce(torch.ones(4), backend="mpi").wait()
except mcrdl.MCRDLError as exc:
    print(f"rank {comm.rank}: {type(exc).__name__}", flush=True)
mcrdl.finalize()
