"""Across emulated hosts (tests/test_cluster.py): a host's link is cut mid-run, or its rank is
killed; every other rank's next operations must fail with an mcrdl error within the timeout.

After a first allreduce on each backend, rank 0 creates ``$MCRDL_CLUSTER_DIR/ready``; the
test then cuts the last host's link (``ip link set v<last> down``) or kills its rank; this
program goes on with an allreduce per backend, each on a fresh tensor. Each rank writes
``rank=R mpi=<error class or none> gloo=<...> after=<seconds>`` to
``$MCRDL_RESULT_DIR/rank<R>.txt`` (a file: the launcher may stop forwarding output once a
host is gone).
"""

import os
import time

import torch

import mcrdl

out_dir = os.environ["MCRDL_RESULT_DIR"]
comm = mcrdl.init()
for backend in ("mpi", "gloo"):
    comm.allreduce(torch.ones(4), backend=backend).wait()
comm.barrier(backend="mpi").wait()
if comm.rank == 0:
    open(os.path.join(os.environ["MCRDL_CLUSTER_DIR"], "ready"), "w").close()
time.sleep(1.0)  # the link goes down meanwhile
t0 = time.perf_counter()
errors = {}
for backend in ("mpi", "gloo"):
    try:
        for _ in range(3):  # small messages may still be in a socket buffer: more than one
            comm.allreduce(torch.ones(1 << 16), backend=backend).wait()
        errors[backend] = "none"
    except mcrdl.MCRDLError as exc:
        errors[backend] = type(exc).__name__
line = (f"rank={comm.rank} mpi={errors['mpi']} gloo={errors['gloo']}"
        f" after={time.perf_counter() - t0:.1f}")
with open(os.path.join(out_dir, f"rank{comm.rank}.txt"), "w") as fh:
    fh.write(line + "\n")
print(line, flush=True)
mcrdl.finalize()
