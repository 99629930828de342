"""Train with DeepSpeed's ZeRO (stages 1, 2 and 3) over the "mcrdl" backend.

    torchrun --nproc-per-node 2 examples/deepspeed_zero.py          # stages 1, 2, 3 in turn
    torchrun --nproc-per-node 2 examples/deepspeed_zero.py --stages 3
    ... --backend gloo                                 # the same over torch's gloo

DeepSpeed is unchanged but for ``deepspeed.init_distributed(dist_backend="mcrdl")``: the name
reaches torch through mcrdl's ``torch.backends`` entry point, with no ``import mcrdl``, and
mcrdl comes up from torchrun's store. ZeRO partitions the optimizer state (stage 1), the
gradients too (2, reduce-scatters) and the parameters too (3, all-gathers before each layer
runs). Each stage trains the same model from the same start. ``--out FILE`` writes each
stage's losses and the parameters it ended with, gathered from their partitions, for
comparing backends.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def train(stage: int, steps: int) -> tuple[list[float], list[list[float]]]:
    """Train the model with ZeRO ``stage``: the mean loss per step, the final parameters."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        # Small buckets, so that a step makes several collectives of each kind.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000,
                              "allgather_bucket_size": 1000,
                              "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=config)
    g = torch.Generator().manual_seed(1 + rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), torch.tanh(x @ w))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / size)
    # Stage 3 keeps each rank's partition only: gather the whole parameters to read them.
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().flatten().tolist() for p in engine.module.parameters()]
    engine.destroy()
    return losses, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mcrdl", help="mcrdl (default) or gloo")
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages to run, in turn")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the run's end state here (JSON)")
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*is deprecated.*", FutureWarning)  # DeepSpeed's calls

    deepspeed.init_distributed(dist_backend=args.backend)
    report = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}
    for stage in (int(s) for s in args.stages.split(",")):
        losses, params = train(stage, args.steps)
        report[f"stage{stage}"] = {"losses": losses, "params": params}
        if dist.get_rank() == 0:
            print(f"{report['backend']}: ZeRO stage {stage}, {report['world_size']} ranks, "
                  f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(report, f)
    # torch's gloo can abort at exit when a group is torn down while objects holding its
    # work are still alive: free them, and leave together.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
