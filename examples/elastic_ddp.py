"""examples/elastic.py with torch's DistributedDataParallel (or FSDP2) over "mcrdl": a rank
dies, the survivors make torch's default group one of themselves, wrap the model again and
train on.

    python -m mcrdl run -n 3 examples/elastic_ddp.py --die-rank 1 --die-step 4
    python -m mcrdl run -n 3 examples/elastic_ddp.py --die-rank 1 --die-step 4 --fsdp

The same model, batches and reference as examples/elastic.py, through torch: DDP averages the
gradients (its bucket allreduce over "mcrdl"), or FSDP2 shards the parameters and
reduce-scatters them (``--fsdp``); SGD applies them. Each rank keeps the full parameters as
they were after each step (FSDP2's gathered from the shards: a lost rank takes its shard
with it). When rank ``--die-rank`` kills itself at ``--die-step``, the survivors' backward
fails (DDP and FSDP2 raise the error of their collective); each calls
``mcrdl.torch.shrink()``, which agrees on the survivors and makes torch's default group
theirs, wraps a model holding the parameters kept for the earliest step any survivor is at
again, and redoes that step. At the end the lowest survivor compares the parameters with the
reference.

Under Open MPI's ``mpiexec --with-ft ulfm`` it starts through `mcrdl.torch.init_process_group`
(no torchrun environment there).
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


def wrapped(w: torch.Tensor, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model holding ``w``, in DDP or FSDP2 over the current default group, and its
    optimizer."""
    model: torch.nn.Module = torch.nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(w.unsqueeze(0))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # (its one row on one rank, padding on the others)
    else:
        model = DDP(model)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def full_weight(model: torch.nn.Module) -> torch.Tensor:
    """The model's whole weight, as a vector (FSDP2's gathered from every rank's shard)."""
    weight = model.module.weight if isinstance(model, DDP) else model.weight
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    return weight.detach().clone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--die-step", type=int, default=4)
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()

    if "RANK" in os.environ:  # torchrun's environment (python -m mcrdl run): torch finds it
        dist.init_process_group("mcrdl")
    else:  # mpiexec
        mcrdl.torch.init_process_group()
    me, size = dist.get_rank(), dist.get_world_size()  # world ranks: batches are drawn from them
    members = list(range(size))
    model, opt = wrapped(torch.zeros(DIM, dtype=torch.float64), args.fsdp)
    kept = {0: full_weight(model)}  # the full weight at the start of the last two steps
    step, shrunk = 0, False
    redone = args.die_step  # the step the survivors redo (see examples/elastic.py)
    while step < args.steps:
        if step == args.die_step and me == args.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if shrunk:  # every survivor redoes the earliest step any of them is at
                earliest = torch.tensor([step])
                dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
                step = redone = int(earliest)
                model, opt = wrapped(kept[step], args.fsdp)
                shrunk = False
            x, y = batch(me, step)
            opt.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).mean().backward()
            opt.step()
            after = full_weight(model)  # (a step is done once every rank has its result)
        except Exception as exc:  # noqa: BLE001 - DDP and FSDP2 raise their collective's error
            print(f"rank {me}: step {step}: {str(exc).splitlines()[0][:120]}", flush=True)
            members = list(mcrdl.torch.shrink().members)
            shrunk = True
            continue
        kept = {step: kept[step], step + 1: after}  # a survivor is at most a step ahead
        step += 1

    lost = set(range(size)) - set(members)
    w = kept[step]
    match = torch.allclose(w, reference(size, lost, redone, args.steps), rtol=1e-12,
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
