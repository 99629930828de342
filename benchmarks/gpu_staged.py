"""MPI on CUDA tensors, staged through pinned host memory: its cost, and its overlap with compute.

    mpiexec -n 2 python benchmarks/gpu_staged.py      # ranks may share one GPU

Per message size, timed in alternating pairs with a barrier before each call (medians of
rank 0's times): mcrdl's ``comm.allreduce(x, backend="mpi").wait()`` on a CUDA tensor (the
copy to pinned host memory on the adapter's copy stream after the caller's work, MPI on host
memory, the copy back) against the same done by hand (copy to a pinned tensor, synchronize,
mpi4py's ``Allreduce`` in place, copy back, synchronize).

Then overlap: a chain of bf16 matrix products on the caller's stream (calibrated on rank 0 to
take about as long as the allreduce), a staged 16 MiB allreduce, and both together (the
allreduce submitted first, the products queued behind it, then both waited for). "hidden" is
how much of the shorter of the two disappeared in the combined time. Ranks that share a GPU
share its compute too: the products' time is measured with all ranks computing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, human, parse_sizes  # noqa: E402
from common import timed as timed_each  # noqa: E402

import mcrdl  # noqa: E402


def _median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4:16M", help="bytes, powers of 4 (default 4:16M)")
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    torch.cuda.set_device(world.Get_rank() % torch.cuda.device_count())
    comm = mcrdl.init(backends=["mpi"])
    mpi = comm.runtime.backend("mpi")
    way = "direct (CUDA-aware)" if "cuda" in mpi.capabilities.direct else "staged"
    stream = torch.cuda.current_stream()
    if comm.rank == 0:
        print(f"{comm.size} ranks on {torch.cuda.device_count()} GPU(s) "
              f"({torch.cuda.get_device_name(0)}), torch {torch.__version__}, MPI on CUDA "
              f"tensors: {way}")
        print(f"{'bytes':>8} {'by hand us':>11} {'mcrdl us':>9} {'ratio':>6}")
    for nbytes in parse_sizes(args.sizes):
        x = torch.ones(max(1, nbytes // 4), device="cuda")
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)

        def by_hand() -> None:
            host.copy_(x, non_blocking=True)
            stream.synchronize()
            world.Allreduce(MPI.IN_PLACE, host.numpy())
            x.copy_(host, non_blocking=True)
            stream.synchronize()

        def ours() -> None:
            comm.allreduce(x, backend="mpi").wait()

        a, b = alternate(by_hand, ours, args.iters, sync=world.Barrier)
        if comm.rank == 0:
            ra, rb = _median_us(a), _median_us(b)
            print(f"{human(nbytes):>8} {ra:11.1f} {rb:9.1f} {rb / ra:6.2f}")

    big = torch.ones(4 << 20, device="cuda")  # 16 MiB
    m = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def products(k: int) -> None:
        for _ in range(k):
            torch.mm(m, m)

    def synced() -> None:  # the ranks together, their devices idle
        world.Barrier()
        torch.cuda.synchronize()

    def timed(call, reps: int = 15) -> float:  # type: ignore[no-untyped-def]
        """Median µs of ``call`` and the device work it queued."""
        def whole() -> None:
            call()
            torch.cuda.synchronize()

        whole()
        return _median_us(timed_each(whole, reps, synced))

    comm_us = timed(lambda: comm.allreduce(big, backend="mpi").wait())
    one_us = timed(lambda: products(10)) / 10
    k = world.bcast(max(1, round(comm_us / one_us)) if comm.rank == 0 else None, root=0)
    compute_us = timed(lambda: products(k))

    def both() -> None:
        fut = comm.allreduce(big, backend="mpi")
        products(k)
        fut.wait()

    both_us = timed(both)
    if comm.rank == 0:
        hidden = max(0.0, comm_us + compute_us - both_us) / min(comm_us, compute_us)
        print(f"overlap: {k} bf16 2048^3 products {compute_us:.0f} us, staged allreduce 16 MiB "
              f"{comm_us:.0f} us, both {both_us:.0f} us (sum {comm_us + compute_us:.0f} us; "
              f"hidden {hidden * 100:.0f}% of the shorter)")
    mcrdl.finalize()


if __name__ == "__main__":
    main()
