"""Data-parallel training that loses a rank and goes on: the survivors shrink the
communicator to themselves and finish.

    python -m mcrdl run -n 3 examples/elastic.py --die-rank 1 --die-step 4

Each rank trains the same linear model on batches of its own (drawn from its rank and the
step), averaging the gradients with an allreduce each step. At ``--die-step``, rank
``--die-rank`` kills itself (SIGKILL) in the middle of the step; the survivors' allreduce
fails, with `mcrdl.PeerLostError` once the launcher has told them, or with the backend's
`mcrdl.BackendError` where the backend saw it first (gloo: "Connection closed by peer").
They call ``comm.shrink()`` to agree on who is alive and get a communicator of those ranks,
and redo the step among themselves. A survivor that had
already finished that step (its allreduce completed before the loss) goes back to the state
it kept at the step's start, so that all of them redo the same step.

The launcher must let the survivors live and tell them of the death: ``python -m mcrdl
run`` does (docs/reliability.md, "A dead peer"), and so does Open MPI's with its fault
tolerance on, where the ranks learn of it from their connections to each other:

    mpiexec --with-ft ulfm -n 3 python examples/elastic.py --backend gloo

``--backend`` names the backend of the allreduce (default: mcrdl's choice). At the end,
the lowest survivor checks the
parameters against a reference computed in one process: every rank's batches before the
step the survivors redo, the survivors' from it on (the lost step, or the one before where
a survivor learned of the loss while its allreduce of that step was still in flight: the
dead rank had finished it, but a survivor cannot know that, and fails it). ``--out DIR`` writes each survivor's figures there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import mcrdl

DIM, BATCH, LR = 8, 16, 0.05


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """World rank ``rank``'s batch at ``step``: inputs and targets."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, DIM + 1, dtype=torch.float64)
    y += 0.1 * torch.randn(BATCH, generator=g, dtype=torch.float64)
    return x, y


def gradient(w: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """The mean-squared-error gradient of world rank ``rank``'s batch at ``step``."""
    x, y = batch(rank, step)
    return 2 * x.T @ (x @ w - y) / BATCH


def reference(size: int, lost: set[int], die_step: int, steps: int) -> torch.Tensor:
    """The parameters the survivors must end with, computed here alone."""
    w = torch.zeros(DIM, dtype=torch.float64)
    for step in range(steps):
        ranks = [r for r in range(size) if step < die_step or r not in lost]
        w = w - LR * sum(gradient(w, r, step) for r in ranks) / len(ranks)
    return w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--die-step", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()

    comm = mcrdl.init()
    me, size = comm.rank, comm.size  # (world ranks: the batches are drawn from them)
    w = torch.zeros(DIM, dtype=torch.float64)
    kept = {0: w}  # the state at the start of this step and of the one before
    step, lost_at, first_after, shrunk = 0, None, None, False
    # The step the survivors redo: the lost one, or the one before where a survivor learned
    # of the loss while its allreduce of that step was still in flight.
    redone = args.die_step
    while step < args.steps:
        if step == args.die_step and me == args.die_rank:
            if args.out:
                with open(os.path.join(args.out, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        kept = {step - 1: kept.get(step - 1, w), step: w}  # a survivor is at most a step ahead
        try:
            if shrunk:  # every survivor redoes the earliest step any of them is at
                step = int(comm.allgather(torch.tensor([step])).wait().min())
                w, shrunk, redone = kept[step], False, step
                print(f"rank {me}: survivors {list(comm.members)}, from step {step}",
                      flush=True)
            total = comm.allreduce(gradient(w, me, step), backend=args.backend).wait()
        except (mcrdl.PeerLostError, mcrdl.BackendError) as exc:  # (see the docstring)
            lost_at = lost_at or time.time()
            print(f"rank {me}: step {step}: {str(exc).splitlines()[0]}", flush=True)
            comm, shrunk = comm.shrink(), True  # (a loss meanwhile: it fails here again)
            continue
        w = w - LR * total / comm.size
        step += 1
        if lost_at is not None and first_after is None:
            first_after = time.time()

    lost = set(range(size)) - set(comm.members)
    expected = reference(size, lost, redone, args.steps)
    match = torch.allclose(w, expected, rtol=1e-12, atol=0)
    if comm.rank == 0:
        print(f"survivors {list(comm.members)} of {size}: the parameters "
              f"{'match' if match else 'DIFFER FROM'} the reference", flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{me}.json"), "w") as f:
            json.dump({"members": list(comm.members), "match": match, "w": w.tolist(),
                       "lost_at": lost_at, "first_step_after": first_after}, f)
    mcrdl.finalize()
    if not match:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
