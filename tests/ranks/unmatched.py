"""Messages no receive matched, at close and at exit (tests/test_multirank.py).

    mpiexec -n 2 python unmatched.py

On two sub-communicators, rank 0 sends 4 messages that rank 1 never receives. Rank 1 closes
the first itself, which must raise a BackendError that says why, and leaves the second to
finalize at exit, which must report it in one line and end the process normally (mpi4py
raised at exit, and MPI_Finalize then failed on the handle the refused free invalidated).
"""

import torch

import mcrdl

comm = mcrdl.init()
first, second = comm.split(0), comm.split(0)
for sub in (first, second):
    if comm.rank == 0:
        for tag in range(4):
            sub.send(torch.ones(4), 1, tag=tag, backend="mpi").wait()
    sub.allreduce(torch.ones(4), backend="mpi").wait()
if comm.rank == 1:
    try:
        first.close()
    except mcrdl.BackendError as exc:
        print(f"rank 1 close: {exc}", flush=True)
else:
    first.close()
print(f"rank {comm.rank} done", flush=True)
