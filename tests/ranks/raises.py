"""Run by tests/test_survivors.py from a given store (no launcher tells of deaths): rank 1
ends on an exception it does not catch while rank 0 waits in an allreduce with it. mcrdl's
exit handler closes the mesh without a goodbye, so rank 0 learns that rank 1 is gone at
once (PeerLostError) instead of waiting out its timeout.

    python tests/ranks/given_store.py 2 tests/ranks/raises.py OUT_DIR

Rank 0 writes ``OUT_DIR/rank0.txt``: ``<error class> after=<seconds>``.
"""

import os
import sys
import time

import torch

import mcrdl

comm = mcrdl.init(backends="gloo")
comm.barrier().wait()
if comm.rank == 1:
    time.sleep(0.5)
    raise RuntimeError("rank 1 fails on purpose")
t0 = time.monotonic()
try:
    comm.allreduce(torch.ones(2)).wait()
    outcome = "no error"
except mcrdl.MCRDLError as exc:
    outcome = type(exc).__name__
with open(os.path.join(sys.argv[1], "rank0.txt"), "w") as f:
    f.write(f"{outcome} after={time.monotonic() - t0:.2f}\n")
