"""Submit, compute, then look: has communication advanced during the compute?

Prints one line per rank: ``overlap rank=R mpi_done=B gloo_done=B`` as seen right after the
compute, before any wait. Run with MCRDL_PROGRESS_THREAD=0 as the negative control.
"""

import time

import torch

import mcrdl

torch.set_num_threads(1)
comm = mcrdl.init()
comm.barrier().wait()
a = torch.ones(4 << 20)  # 16 MiB: MPI needs polls to move it
b = torch.ones(1 << 20)
fa = comm.allreduce(a, backend="mpi")
fb = comm.allreduce(b, backend="gloo")
m = torch.randn(384, 384)
t0 = time.perf_counter()
while time.perf_counter() - t0 < 1.0:  # compute (torch releases the GIL)
    m = (m @ m).clamp_(-1, 1)
mpi_done, gloo_done = fa.done(), fb.done()
fa.wait()
fb.wait()
assert a[0].item() == comm.size and b[0].item() == comm.size
print(f"overlap rank={comm.rank} mpi_done={mpi_done} gloo_done={gloo_done}", flush=True)
mcrdl.finalize()
