"""Run by ``python -m mcrdl run`` (tests/test_cli.py).

    python -m mcrdl run -n 3 tests/ranks/launched.py ok|die OUT_DIR

``ok``: mcrdl up from the launcher's store, an allreduce, then torch.distributed's default
group over "mcrdl" from ``env://`` and an all_reduce through it. ``die``: after a first
allreduce, rank 1 kills itself (SIGKILL); the others each try another, report what it raised
and how long it took, and end normally. Each rank that ends writes ``OUT_DIR/rank<R>.txt``.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import mcrdl

mode, out = sys.argv[1], sys.argv[2]
comm = mcrdl.init()
rank = comm.rank
first = comm.allreduce(torch.ones(2)).wait().tolist()
if mode == "ok":
    dist.init_process_group("mcrdl")
    t = torch.ones(3)
    dist.all_reduce(t)
    report = (f"launcher={comm.runtime.bootstrap.launcher} size={comm.size} first={first} "
              f"torch={t.tolist()}")
    dist.destroy_process_group()
else:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # rank 1 is gone by now
    t0 = time.monotonic()
    try:
        comm.allreduce(torch.ones(2)).wait()
        outcome = "no error"
    except mcrdl.MCRDLError as exc:
        outcome = type(exc).__name__
    report = f"lived after rank 1 died: {outcome} after={time.monotonic() - t0:.1f}"
with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
    f.write(report + "\n")
mcrdl.finalize()
