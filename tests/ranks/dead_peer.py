"""One rank is killed with SIGKILL mid-run; the survivors must raise within the timeout.

Launched by tests/test_multirank.py as ``mpiexec -disable-auto-cleanup -n 3`` (with hydra's
default cleanup the survivors are killed along with the dead rank instead). Prints one line
per survivor, in $MCRDL_RESULT_DIR/rank<R>.txt:
``survivor rank=R mpi=<error class> gloo=<error class> after=<seconds>``. The
MPI operation is issued before the peer dies, the gloo one after.
"""

import os
import signal
import time

# Hydra ends a survivor that writes to the launcher's stdout/stderr after a rank died (gloo
# logs its failed reconnects there): keep this process's output in a file of its own.
_out = os.open(os.path.join(os.environ["MCRDL_RESULT_DIR"], f"out{os.environ.get('PMI_RANK')}.log"),
               os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(_out, 1)
os.dup2(_out, 2)

import torch  # noqa: E402

import mcrdl  # noqa: E402

TIMEOUT = float(os.environ.get("MCRDL_TIMEOUT", "3"))
comm = mcrdl.init()
comm.barrier().wait()
if comm.rank == comm.size - 1:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
t0 = time.perf_counter()
errors = {}
for backend in ("mpi", "gloo"):
    try:
        comm.allreduce(torch.ones(4), backend=backend).wait()
        errors[backend] = "none"
    except mcrdl.MCRDLError as exc:
        errors[backend] = type(exc).__name__
line = (f"survivor rank={comm.rank} mpi={errors['mpi']} gloo={errors['gloo']} "
        f"after={time.perf_counter() - t0:.1f}")
# A file, not stdout: the launcher stops forwarding output once a rank has died. Written
# whole or not at all (renamed into place): hydra may end this process at any moment, and once
# did between the file's creation and its write, leaving an empty report.
path = os.path.join(os.environ["MCRDL_RESULT_DIR"], f"rank{comm.rank}.txt")
with open(path + ".part", "w") as fh:
    fh.write(line + "\n")
os.replace(path + ".part", path)
