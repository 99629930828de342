"""Ill-formed programs for ``python -m mcrdl trace explain`` (tests/test_multirank.py).

    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 3 python stuck.py skip
    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 2 python stuck.py cycle
    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 2 python stuck.py recv
    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 2 python stuck.py collrecv
    MCRDL_FLIGHT_RECORDER=dir/fr-{rank}.json mpiexec -n 2 python stuck.py gloo

``skip`` (3 ranks): ranks 0 and 2 allreduce on the world; rank 1 skips it and waits instead
for an allreduce on the communicator it shares with rank 0, which rank 0 never issues.
``cycle`` (2 ranks): two communicators over both ranks; rank 0 blocks on an allreduce on
the first, rank 1 on one on the second. ``recv`` (2 ranks): each receives from the other
(tags 7 and 9) before it would send. ``collrecv`` (2 ranks): rank 0 blocks in an MPI
allreduce on the world, which rank 1 never reaches: it blocks in a gloo receive from rank 0
(tag 1), whose send comes after the allreduce. In these two, rank 1's runtime has a timeout
of 60 s: rank 0 times out, and rank 1 learns of it from rank 0's notice. ``gloo`` (2 ranks,
the same timeouts): rank 0 blocks in a gloo allreduce that rank 1 never issues (it blocks in
a receive instead). Each rank writes ``$MCRDL_RESULT_DIR/stuck<R>``
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

mode = sys.argv[1]
p2p = mode in ("recv", "collrecv", "gloo")
comm = mcrdl.init(**({"timeout": 60.0} if p2p and os.environ.get("PMI_RANK") == "1" else {}))
if p2p:
    comm.allreduce(torch.ones(4), backend="gloo").wait()
    comm.allreduce(torch.ones(4), backend="mpi").wait()
    open(os.path.join(os.environ["MCRDL_RESULT_DIR"], f"stuck{comm.rank}"), "w").close()
    peer = 1 - comm.rank
    try:
        if mode == "gloo" and comm.rank == 0:
            comm.allreduce(torch.ones(4), backend="gloo").wait()
        elif mode == "gloo":
            comm.recv(torch.empty(4), 0, tag=5).wait()
        elif mode == "recv":
            comm.recv(torch.empty(4), peer, tag=7 if comm.rank == 0 else 9).wait()
            comm.send(torch.ones(4), peer, tag=9 if comm.rank == 0 else 7).wait()
        elif comm.rank == 0:
            comm.allreduce(torch.ones(4), backend="mpi").wait()
            comm.send(torch.ones(4), peer, tag=1, backend="gloo").wait()
        else:
            comm.recv(torch.empty(4), peer, tag=1, backend="gloo").wait()
            comm.allreduce(torch.ones(4), backend="mpi").wait()
    except mcrdl.MCRDLError as exc:
        print(f"rank {comm.rank}: {type(exc).__name__}", flush=True)
    mcrdl.finalize()
    sys.exit(0)
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
