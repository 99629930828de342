"""Run by tests/test_survivors.py under MPICH's ``mpiexec -disable-auto-cleanup -n 3``:
MPI and gloo up, rank 0 (whose process served the store) dies while the others are idle.
The survivors learn of it through the mesh, and shrink: the new world goes on without MPI
(MPICH cannot make a group once a process is gone), a RuntimeWarning saying so; an
operation named for MPI there raises BackendUnavailableError, and an allreduce, a named one
and a split run on gloo.

    mpiexec -disable-auto-cleanup -n 3 python tests/ranks/mpich_survivors.py OUT_DIR

Each survivor writes ``OUT_DIR/rank<R>.txt``. Its output goes to ``OUT_DIR/out<R>.log``:
hydra ends a survivor that writes to the launcher's output after a death.
"""

import os
import signal
import sys
import time
import warnings

out = sys.argv[1]
_log = os.open(os.path.join(out, f"out{os.environ['PMI_RANK']}.log"),
               os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(_log, 1)
os.dup2(_log, 2)

import torch  # noqa: E402

import mcrdl  # noqa: E402

comm = mcrdl.init()
assert set(comm.backends) == {"mpi", "gloo"}, comm.backends
comm.barrier().wait()
if comm.rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)  # nothing in flight while it dies
try:
    comm.allreduce(torch.ones(2), backend="gloo").wait()
    first = "no error"
except mcrdl.MCRDLError as exc:
    first = type(exc).__name__
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    world = comm.shrink()
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
try:
    world.allreduce(torch.ones(1), backend="mpi")
    refused = "no error"
except mcrdl.BackendUnavailableError as exc:
    refused = str(exc)
total = world.allreduce(torch.full((2,), float(comm.rank))).wait().tolist()
named = world.allreduce(torch.ones(1), name="grad/w").wait().tolist()
alone = world.split(world.rank)
with open(os.path.join(out, f"rank{comm.rank}.txt"), "w") as f:
    f.write(f"first={first}\nbackends={list(world.backends)} members={list(world.members)}\n"
            f"said={said}\nrefused={refused}\nsum={total} named={named} split={alone.size}\n")
mcrdl.finalize()
