"""Train a small model with PyTorch's DistributedDataParallel over the "mcrdl" backend.

    mpiexec -n 2 python examples/ddp.py [--backend mpi|gloo|auto] [--steps 50]

DDP is unchanged: it sees a torch.distributed process group. Its bucket allreduces run in
mcrdl's engine on the backend pinned here (``--backend``; default: mcrdl's choice), while
the program's own ``comm.alltoall`` runs beside them on gloo in the same step, on the same
communicator. The report: loss at the start and the end, step time, and how many operations
each backend ran.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
import torch.distributed as dist

import mcrdl
import mcrdl.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="mpi, gloo or auto (default: mcrdl's)")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    mcrdl.torch.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = mcrdl.torch.communicator()
    mcrdl.torch.set_backend(None, args.backend)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1 + rank)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    counts: Counter[str] = Counter()  # operations submitted, per backend
    stop = comm.runtime.engine.observe(
        lambda fut, after: counts.update([fut.lane.backend_name]))
    losses, t0 = [], time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        y = x @ w_true
        side = comm.alltoall(torch.arange(4.0 * size) + rank, backend="gloo")  # our own op
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        side.wait()
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    stop()
    if rank == 0:
        print(f"DDP over mcrdl, {size} ranks, backend {args.backend or 'mcrdl default'}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
        print(f"step time {elapsed / args.steps * 1e3:.2f} ms; operations per backend: "
              f"{dict(counts)} (DDP's bucket allreduces and our own alltoall)")
    dist.destroy_process_group()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
