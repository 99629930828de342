"""examples/elastic.py with torch's DistributedDataParallel over "mcrdl": a rank dies, the
survivors make torch's default group one of themselves, wrap the model again and train on.

    python -m mcrdl run -n 3 examples/elastic_ddp.py --die-rank 1 --die-step 4

The same model, batches and reference as examples/elastic.py, through torch: DDP averages the
gradients (its bucket allreduce over "mcrdl"), SGD applies them. When rank ``--die-rank``
kills itself at ``--die-step``, the survivors' backward fails (DDP raises the error of its
allreduce); each calls ``mcrdl.torch.shrink()``, which agrees on the survivors and makes
torch's default group theirs, wraps a model holding the parameters of the step's start in
DDP again, and redoes the step. At the end the lowest survivor compares the parameters with
the reference.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mcrdl.torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic import DIM, LR, batch, reference  # noqa: E402


def wrapped(w: torch.Tensor) -> tuple[DDP, torch.optim.Optimizer]:
    """A model holding ``w``, in DDP over the current default group, and its optimizer."""
    model = torch.nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(w.unsqueeze(0))
    ddp = DDP(model)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=LR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--die-step", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("mcrdl")  # (torchrun's environment, from python -m mcrdl run)
    me, size = dist.get_rank(), dist.get_world_size()  # world ranks: batches are drawn from them
    members = list(range(size))
    ddp, opt = wrapped(torch.zeros(DIM, dtype=torch.float64))
    kept = {0: ddp.module.weight.detach().clone()[0]}
    step, shrunk = 0, False
    while step < args.steps:
        if step == args.die_step and me == args.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        w = ddp.module.weight.detach().clone()[0]
        kept = {step - 1: kept.get(step - 1, w), step: w}  # a survivor is at most a step ahead
        try:
            if shrunk:  # every survivor redoes the earliest step any of them is at
                earliest = torch.tensor([step])
                dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
                step = int(earliest)
                ddp, opt = wrapped(kept[step])
                shrunk = False
            x, y = batch(me, step)
            opt.zero_grad()
            ((ddp(x).squeeze(1) - y) ** 2).mean().backward()
        except Exception as exc:  # noqa: BLE001 - DDP raises its allreduce's error as its own
            print(f"rank {me}: step {step}: {str(exc).splitlines()[0][:120]}", flush=True)
            members = list(mcrdl.torch.shrink().members)
            shrunk = True
            continue
        opt.step()
        step += 1

    lost = set(range(size)) - set(members)
    w = ddp.module.weight.detach()[0]
    match = torch.allclose(w, reference(size, lost, args.die_step, args.steps), rtol=1e-12,
                           atol=0)
    if dist.get_rank() == 0:
        print(f"survivors {members} of {size}: the parameters "
              f"{'match' if match else 'DIFFER FROM'} the reference", flush=True)
    dist.destroy_process_group()
    mcrdl.finalize()
    if not match:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
