"""Gradient buckets as concurrent asyncio tasks, matched across ranks by name.

Run it on two ranks:

    mpiexec -n 2 python examples/named_buckets.py

Each step runs one task per gradient bucket: the task "computes" its bucket (a sleep whose
length differs per rank and per step, as backward passes do), then allreduces it. The tasks
therefore submit their allreduces in a different order on every rank. Unnamed, the ranks
would pair different buckets (MPI and NCCL match collectives by call order); with
``name=``, mcrdl matches them by name, in an order the ranks agree on, and every bucket
gets its own sum. A pipeline's micro-batches work the same way: one task per micro-batch,
each naming its sends' collectives by micro-batch and stage.
"""

from __future__ import annotations

import asyncio
import random

import torch

import mcrdl

BUCKETS = 6
STEPS = 5


async def bucket(comm: mcrdl.Communicator, i: int, grad: torch.Tensor,
                 rng: random.Random) -> None:
    await asyncio.sleep(rng.random() * 0.005)  # this rank's backward for bucket i
    grad.fill_(float(comm.rank + i))
    await comm.allreduce(grad, mcrdl.ReduceOp.AVG, name=f"grad/bucket{i}")


async def step(comm: mcrdl.Communicator, grads: list[torch.Tensor], rng: random.Random) -> None:
    await asyncio.gather(*(bucket(comm, i, g, rng) for i, g in enumerate(grads)))


def main() -> None:
    with mcrdl.init() as comm:
        rng = random.Random(comm.rank)  # a different timing on every rank
        grads = [torch.empty(1024 * (i + 1)) for i in range(BUCKETS)]
        for _ in range(STEPS):
            asyncio.run(step(comm, grads, rng))
        mean_rank = (comm.size - 1) / 2
        for i, g in enumerate(grads):
            assert torch.all(g == mean_rank + i), (i, g[:4])
        print(f"rank {comm.rank}: {STEPS} steps of {BUCKETS} named buckets, each averaged "
              f"on its own (bucket i holds {mean_rank:g} + i everywhere)")


if __name__ == "__main__":
    main()
