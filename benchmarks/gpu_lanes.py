"""GPU lanes on one GPU: mcrdl's nccl backend against torch's ProcessGroupNCCL, in one run.

    python benchmarks/gpu_lanes.py            # a world of one process (one GPU, one NCCL rank)

Prints, per message size, the median latency of an allreduce waited on by the host
(``fut.wait()`` against ``work.wait()`` and a stream synchronize), their ratio; the host cost of
``fut.wait_stream()``; and the overlap of a matrix product on the caller's stream with an
allreduce on mcrdl's lane stream (time of both together against the sum of each alone). With one
rank NCCL moves no data between GPUs: these are the engine's costs on a GPU, not bandwidth.
"""

from __future__ import annotations

import statistics
import time

import torch

import mcrdl

SIZES = [4, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
REPS = 50


def _median_us(fn, reps=REPS):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.cuda.set_device(0)
    comm = mcrdl.init(backends=["gloo", "nccl"])
    pg = comm._slots["nccl"].group.pg  # the same ProcessGroupNCCL, called directly
    stream = torch.cuda.current_stream()
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    print(f"{'bytes':>10} {'raw us':>9} {'mcrdl us':>9} {'ratio':>6}")
    for nbytes in SIZES:
        t = torch.ones(max(1, nbytes // 4), device="cuda")

        def raw() -> None:
            pg.allreduce([t]).wait()
            stream.synchronize()

        def ours() -> None:
            comm.allreduce(t, backend="nccl").wait()

        r, m = _median_us(raw), _median_us(ours)
        print(f"{nbytes:>10} {r:9.1f} {m:9.1f} {m / r:6.2f}")
    t = torch.ones(1 << 20, device="cuda")
    costs = []
    for _ in range(REPS):
        fut = comm.allreduce(t, backend="nccl")
        t0 = time.perf_counter()
        fut.wait_stream()
        costs.append(time.perf_counter() - t0)
        fut.wait()
    print(f"wait_stream host cost: median {statistics.median(costs) * 1e6:.1f} us")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big = torch.ones(64 << 20 >> 2, device="cuda")

    def compute() -> None:
        (a @ a).sum()
        torch.cuda.synchronize()

    def comm_only() -> None:
        comm.allreduce(big, backend="nccl").wait()

    def both() -> None:
        fut = comm.allreduce(big, backend="nccl")
        (a @ a).sum()
        fut.wait()
        torch.cuda.synchronize()

    c, o, b = _median_us(compute, 20), _median_us(comm_only, 20), _median_us(both, 20)
    print(f"overlap: compute {c:.0f} us, allreduce 64 MiB {o:.0f} us, both {b:.0f} us "
          f"(sum {c + o:.0f} us; hidden {max(0.0, (c + o - b) / min(c, o)) * 100:.0f}% of the "
          f"shorter)")
    mcrdl.finalize()


if __name__ == "__main__":
    main()
