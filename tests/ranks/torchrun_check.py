"""Under torchrun: no MPI, gloo only, rendezvous through the launcher's store."""

import sys

import torch

import mcrdl

comm = mcrdl.init()
assert comm.backends == ("gloo",), comm.backends
assert "mpi4py.MPI" not in sys.modules
x = torch.full((4,), float(comm.rank + 1))
assert comm.allreduce(x).wait().tolist() == [float(sum(range(1, comm.size + 1)))] * 4
sub = comm.split(0, key=-comm.rank)
got = sub.allgather(torch.tensor([comm.rank])).wait().tolist()
assert got == sorted(range(comm.size), reverse=True), got
try:
    comm.allreduce(x, backend="mpi")
except mcrdl.BackendUnavailableError as exc:
    assert "not available in this runtime; available: gloo" in str(exc)
else:
    raise AssertionError("mpi should be unavailable under torchrun")
print(f"torchrun rank={comm.rank} size={comm.size} ok", flush=True)
mcrdl.finalize()
