"""Run by ``python -m mcrdl run`` (tests/test_cli.py).

    python -m mcrdl run -n 3 tests/ranks/launched.py ok|die[:VICTIM] OUT_DIR

``ok``: mcrdl up from the launcher's store, an allreduce, then torch.distributed's default
group over "mcrdl" from ``env://`` and an all_reduce through it. ``die``: the two ranks
other than VICTIM (default 1) make a communicator of their own, then VICTIM kills itself
(SIGKILL) while the others wait with nothing in flight; then each tries an allreduce on the
world, reports what it raised and how long that took, allreduces on their own communicator,
then shrinks the world to the two of them and runs an allreduce, a named one and a split
there, dumps its flight recorder (``OUT_DIR/fr-<R>.json``), breaks that world (the first
cancels an operation it had not issued) and reports how the other learned of it, and ends
normally (writing a trace when ``MCRDL_TRACE`` says where). Each rank that ends writes ``OUT_DIR/rank<R>.txt``.
Also run by Open MPI's ``mpiexec --with-ft ulfm`` (tests/test_survivors.py).
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
    victim = int(mode.partition(":")[2] or 1)
    pair = comm.split(0 if rank != victim else 1)  # the two others (the victim alone)
    comm.barrier().wait()  # (the pair is made: under mpiexec, rank 0 serves the store)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # nothing in flight while the victim dies
    t0 = time.monotonic()
    try:
        comm.allreduce(torch.ones(2)).wait()
        outcome = "no error"
    except mcrdl.MCRDLError as exc:
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    took = time.monotonic() - t0
    together = pair.allreduce(torch.ones(2)).wait().tolist()
    report = f"after={took:.2f} pair={together} lived after rank {victim} died: {outcome}"
    # The survivors' world: its own operations, named ones, and a communicator split from it.
    world = comm.shrink()
    total = world.allreduce(torch.full((2,), float(rank))).wait().tolist()
    named = world.allreduce(torch.ones(1), name="grad/w").wait().tolist()
    alone = world.split(world.rank)
    world.dump_flight_recorder(os.path.join(out, "fr-{rank}.json"))
    report += (f"\nshrunk: members={list(world.members)} rank={world.rank} sum={total} "
               f"named={named} split={alone.size}")
    # Rule 7 on the survivors: the first cancels an operation it had not issued (held back
    # behind one of its own that nothing polls yet: the jobs run without the progress
    # thread), which breaks their world; the other is told (through the store they now
    # share) instead of waiting out the timeout.
    t0 = time.monotonic()
    if world.rank == 0:
        doomed = world.allreduce(torch.ones(1), after=[alone.barrier()])
        doomed.cancel()
    try:
        world.allreduce(torch.ones(1)).wait()
        told = "no error"
    except mcrdl.MCRDLError as exc:
        told = type(exc).__name__
    report += f"\nbroken after={time.monotonic() - t0:.2f} {told}"
t0 = time.monotonic()
mcrdl.finalize()  # (the trace, when on, is gathered from the live ranks only)
report += f"\nfinalize={time.monotonic() - t0:.2f}"
with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
    f.write(report + "\n")
