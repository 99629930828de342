"""A mixed workload: an MoE-like training step, with auto, each single backend, and torch alone.

    mpiexec -n 2 python benchmarks/moe_step.py [--tuning TABLE]
    mpiexec -n 4 python benchmarks/moe_step.py --tokens 2048

One step: alltoall of bf16 tokens to the experts, expert compute (a matmul), alltoall back,
then the gradient allreduce of a few bf16 and fp32 tensors of different sizes, everything
submitted without waiting in between and waited for at the end. It runs the same step with
backend="auto" (a tuning table if given, else the built-in default), with every single
backend, and with torch.distributed (gloo) alone; prints the median step time of the slowest
rank for each, and checks that all of them computed the same result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mcrdl

GRADS = [(1 << 20, torch.float32), (1 << 18, torch.bfloat16), (4096, torch.float32),
         (1 << 16, torch.bfloat16), (300, torch.float32)]


def make_inputs(rank: int, tokens: int, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-4, 5, (tokens, hidden), generator=g).to(torch.bfloat16)
    grads = [torch.randint(-4, 5, (n,), generator=g).to(dt) for n, dt in GRADS]
    return x, grads


def step_mcrdl(comm, x, grads, w, backend):
    routed = comm.alltoall(x, backend=backend).wait()
    expert = (routed.float() @ w).to(torch.bfloat16)  # expert compute
    back = comm.alltoall(expert, backend=backend)
    futs = [comm.allreduce(g, backend=backend) for g in grads]
    out = back.wait()
    for f in futs:
        f.wait()
    return out


def step_torch(x, grads, w):
    import torch.distributed as dist

    routed = torch.empty_like(x)
    dist.all_to_all_single(routed, x)
    expert = (routed.float() @ w).to(torch.bfloat16)
    back = torch.empty_like(expert)
    dist.all_to_all_single(back, expert)
    works = [dist.all_reduce(g, async_op=True) for g in grads]
    for wk in works:
        wk.wait()
    return back


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tuning", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    comm = mcrdl.init(tuning=args.tuning)
    import torch.distributed as dist

    store = dist.PrefixStore("moe/raw", comm.runtime.bootstrap.store())
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
    tokens = args.tokens // comm.size * comm.size
    w = torch.eye(args.hidden) * 2
    variants: list[tuple[str, object]] = [("auto", None)] + [(b, b) for b in comm.backends]
    variants.append(("torch.distributed", "torch"))
    results, reference = {}, None
    for name, backend in variants:
        times = []
        for i in range(args.steps + 2):
            x, grads = make_inputs(comm.rank, tokens, args.hidden)
            comm.barrier(backend="mpi" if "mpi" in comm.backends else None).wait()
            t0 = time.perf_counter()
            if backend == "torch":
                out = step_torch(x, grads, w)
            else:
                out = step_mcrdl(comm, x, grads, w, backend)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        comm.allreduce(med, mcrdl.ReduceOp.MAX, backend=comm.runtime.control_backend).wait()
        results[name] = med.item()
        digest = (out.float().sum().item(), [g.float().sum().item() for g in grads])
        if reference is None:
            reference = digest
        elif digest != reference:
            raise AssertionError(f"{name} computed {digest}, auto computed {reference}")
    if comm.rank == 0:
        table = comm.runtime.tuning.hash[:12] if comm.runtime.tuning else "none (built-in)"
        print(f"# MoE-like step, {comm.size} ranks, {tokens} bf16 tokens x {args.hidden}, "
              f"{len(GRADS)} gradients (bf16 + fp32); tuning table: {table}")
        print(f"{'variant':<20} {'step ms':>9} {'vs auto':>8}")
        for name, sec in results.items():
            print(f"{name:<20} {sec * 1e3:9.2f} {sec / results['auto']:8.2f}")
    dist.destroy_process_group()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
