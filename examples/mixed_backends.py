"""Mixed backends in one program: an MoE-like step with each operation on its own backend.

Run it on two ranks:

    mpiexec -n 2 python examples/mixed_backends.py

The token exchange runs on MPI, the gradient allreduce on gloo, and a bfloat16 reduction goes
wherever ``backend="auto"`` finds it can run; nothing waits between submissions, and mcrdl
keeps the results as if every operation ran in program order.
"""

from __future__ import annotations

import asyncio
import time

import torch

import mcrdl


def step(comm: mcrdl.Communicator, tokens: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    # Dispatch tokens to experts (MPI), compute, send them back (MPI): unwaited.
    routed = comm.alltoall(tokens, backend="mpi")
    expert_out = routed.wait() * 2.0  # "expert compute"
    back = comm.alltoall(expert_out, backend="mpi")
    # Meanwhile, gradients go to gloo: both are in flight at once.
    g = comm.allreduce(grads, mcrdl.ReduceOp.AVG, backend="gloo")
    # bf16 cannot be reduced by MPI: auto sends it to a backend that can.
    bf = comm.allreduce(torch.ones(8, dtype=torch.bfloat16))
    bf.wait()
    g.wait()
    return back.wait()


async def async_step(comm: mcrdl.Communicator, x: torch.Tensor) -> torch.Tensor:
    y = await comm.allreduce(x, backend="mpi")
    z = await comm.allgather(y, backend="gloo")
    return z


def main() -> None:
    with mcrdl.init() as comm:
        n, me = comm.size, comm.rank
        tokens = torch.arange(4 * n, dtype=torch.float32) + 100 * me
        grads = torch.full((1024,), float(me))
        t0 = time.perf_counter()
        out = step(comm, tokens, grads)
        dt = time.perf_counter() - t0
        expected_grad = sum(range(n)) / n
        assert torch.all(grads == expected_grad), grads[:4]
        assert torch.equal(out, tokens * 2.0), (out, tokens)
        z = asyncio.run(async_step(comm, torch.ones(4)))
        assert z.shape == (4 * n,) and torch.all(z == n)
        # Program order across backends on one buffer, nothing waited in between.
        x = torch.ones(16)
        comm.allreduce(x, backend="gloo")
        comm.allreduce(x, backend="mpi")
        comm.allreduce(x, backend="gloo").wait()
        assert torch.all(x == n**3)
        stats = comm.runtime.engine.stats()
        if me == 0:
            print(f"mcrdl {mcrdl.__version__}: {n} ranks, backends {', '.join(comm.backends)}")
            print(f"MoE-like step (alltoall on mpi, allreduce on gloo, bf16 on auto): "
                  f"{dt * 1e3:.2f} ms, results verified")
            print(f"asyncio: await allreduce (mpi) -> await allgather (gloo): {z.tolist()}")
            print(f"program order gloo -> mpi -> gloo on one buffer: x = {x[0].item():g} "
                  f"(= {n}^3)")
            print(f"engine: {stats.completed} operations completed, {stats.failed} failed")


if __name__ == "__main__":
    main()
