"""DDP over the "mcrdl" torch.distributed backend against DDP over torch's own gloo (NCCL
with ``--device cuda``).

    mpiexec -n 2 python benchmarks/ddp.py [--mib 16] [--steps 20]   (and -n 4)
    MCRDL_BACKENDS=gloo,nccl python benchmarks/ddp.py --device cuda   (a world of one per GPU)

One process group of each kind over the same ranks (``dist.new_group(backend="gloo")`` beside
mcrdl's default group); the same model (``--mib`` MiB of float32 gradients, in linear layers
of 4 MiB) wrapped by DDP over each, stepped in alternating blocks. Prints, rank 0:

- step time (median) with mcrdl and with gloo, and their ratio (target: mcrdl <= 0.7x gloo
  at 2 ranks);
- for each, the share of communication hidden behind backward:
  (compute alone + communication alone - step) / min(compute alone, communication alone),
  where compute alone is the same DDP step under ``no_sync()`` (backward and DDP's own
  bookkeeping, no communication) and communication alone is an allreduce of every gradient
  over that group;
- where each step's CPU time goes (Linux): the main thread, mcrdl's progress thread, and
  the other threads (gloo's), per step, beside the step's wall time. Each rank has one core
  on a 2-core host: a step whose threads' CPU adds up to its wall time is bound by CPU, and
  no overlap can make it shorter than that sum;
- the adapter's cost: ``dist.all_reduce`` of 4 bytes over the mcrdl group minus
  ``comm.allreduce(...).wait()`` on the communicator under it, both on mpi, alternating pairs
  (target: under 10 µs), and the 4-byte ``dist.all_reduce`` against gloo's.

On CUDA the model, the batch and the 4-byte tensor are on the GPU, mcrdl chooses its backend
(nccl where it is up), the other group is NCCL's, and every timed call ends with
``torch.cuda.synchronize()`` (a collective returns once it is queued); it adds a 64 MiB
``dist.all_reduce`` against NCCL's.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, timed  # noqa: E402

import mcrdl  # noqa: E402
import mcrdl.torch  # noqa: E402

_LAYER = 1024  # a 1024 x 1024 float32 weight: 4 MiB


def _timed(fn: Callable[[], object], reps: int) -> float:
    return statistics.median(timed(fn, reps, dist.barrier))


def _in_blocks(steps: dict[str, Callable[[], None]], reps: int, block: int = 6
               ) -> dict[str, float]:
    """Median seconds of each of ``steps`` (``reps`` each), run in blocks of ``block`` in a
    row, the first of each block not counted, the blocks alternating (which goes first
    alternates too): a program runs one backend step after step, and step-by-step
    alternation made each pay for the other's leftovers (gloo's threads finishing, mcrdl's
    progress thread napping), while blocks still see the same drift of the machine."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    while min(len(t) for t in times.values()) < reps:
        for name in order:
            for i in range(block):
                t0 = time.perf_counter()
                steps[name]()
                if i:
                    times[name].append(time.perf_counter() - t0)
        order.reverse()
    return {name: statistics.median(t) for name, t in times.items()}


def _thread_cpu() -> dict[int, float]:
    """CPU seconds used so far by each thread of this process (Linux), by native id."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        used[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return used


def _cpu_per_step(fn: Callable[[], None], reps: int, progress: Callable[[], int | None]
                  ) -> dict[str, float] | None:
    """Wall and CPU seconds per call of ``fn``: the main thread, mcrdl's progress thread,
    the others. None where /proc cannot tell."""
    if not os.path.isdir("/proc/self/task"):
        return None
    dist.barrier()
    before, t0 = _thread_cpu(), time.perf_counter()
    for _ in range(reps):
        fn()
    wall, after = time.perf_counter() - t0, _thread_cpu()
    main, bg = threading.main_thread().native_id, progress()
    split = {"wall": wall / reps, "main": 0.0, "progress": 0.0, "other": 0.0}
    for tid, secs in after.items():
        key = "main" if tid == main else "progress" if tid == bg else "other"
        split[key] += (secs - before.get(tid, 0.0)) / reps
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2000, help="pairs for the 4-byte figures")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mcrdl.torch.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = mcrdl.torch.communicator()
    mine = dist.distributed_c10d._get_default_group()
    other_name = "nccl" if cuda else "gloo"
    gloo = dist.new_group(backend=other_name)
    pin = None if cuda else "mpi"  # on CUDA, mcrdl's own choice: a stream-ordered backend
    mcrdl.torch.set_backend(None, pin)
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(max(1, args.mib // 4)):
        layers += [torch.nn.Linear(_LAYER, _LAYER, bias=False), torch.nn.Tanh()]
    base = torch.nn.Sequential(*layers).to(args.device)
    x = torch.randn(16, _LAYER, device=args.device)
    ddps = {name: torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), process_group=pg, bucket_cap_mb=4)
        for name, pg in (("mcrdl", mine), ("gloo", gloo))}

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()
        sync()

    for model in (*ddps.values(), base):  # warm-up: DDP's buckets are built on the first step
        step(model)
        step(model)
    grads = [p.grad for p in base.parameters()]

    def comm_alone(pg: object) -> None:
        works = [dist.all_reduce(g, group=pg, async_op=True) for g in grads]  # type: ignore[arg-type]
        for w in works:
            w.wait()  # type: ignore[union-attr]
        sync()

    def quiet(model: torch.nn.parallel.DistributedDataParallel) -> None:
        with model.no_sync():
            step(model)

    computes = {name: _timed(lambda m=m: quiet(m), args.steps) for name, m in ddps.items()}
    steps = _in_blocks({name: lambda m=m: step(m) for name, m in ddps.items()}, args.steps)
    alone = {"mcrdl": _timed(lambda: comm_alone(mine), args.steps),
             "gloo": _timed(lambda: comm_alone(gloo), args.steps)}

    def progress_thread() -> int | None:
        thread = comm.runtime.engine._thread
        return None if thread is None or thread._thread is None else thread._thread.native_id

    cpu = {name: _cpu_per_step(lambda m=m: step(m), 2 * args.steps, progress_thread)
           for name, m in ddps.items()}

    one = torch.ones(1, device=args.device)
    opts = dist.AllreduceOptions()  # type: ignore[attr-defined]

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: (fn(), sync())  # type: ignore[func-returns-value]

    g, h = alternate(synced(lambda: mine.allreduce([one], opts).wait()),
                     synced(lambda: comm.allreduce(one, backend=pin).wait()), args.pairs)
    c, d = alternate(synced(lambda: dist.all_reduce(one)),
                     synced(lambda: comm.allreduce(one, backend=pin).wait()), args.pairs)
    e, f = alternate(synced(lambda: dist.all_reduce(one)),
                     synced(lambda: dist.all_reduce(one, group=gloo)), max(50, args.pairs // 20))
    large = None
    if cuda:
        big = torch.ones(16 << 20, device="cuda")  # 64 MiB
        large = alternate(synced(lambda: dist.all_reduce(big)),
                          synced(lambda: dist.all_reduce(big, group=gloo)), 50)
    mcrdl.torch.set_backend(None, None)
    if rank == 0:
        mib = sum(g.numel() for g in grads) * 4 / 2**20
        print(f"# DDP on {args.device}, {size} ranks, {mib:.0f} MiB of gradients in 4 MiB "
              f"buckets, median of {args.steps} steps in alternating blocks (rank 0); mcrdl "
              f"{'pinned to ' + pin if pin else 'on its own choice'}; the other: {other_name}")
        for name in ("mcrdl", "gloo"):
            compute = computes[name]
            hidden = (compute + alone[name] - steps[name]) / min(compute, alone[name])
            print(f"{name:>5}: step {steps[name] * 1e3:8.1f} ms | compute alone (no_sync) "
                  f"{compute * 1e3:8.1f} ms | communication alone {alone[name] * 1e3:8.1f} ms"
                  f" | hidden {hidden:5.2f}")
        for name, split in cpu.items():
            if split is not None:
                busy = split["main"] + split["progress"] + split["other"]
                print(f"{name:>5}: per step, wall {split['wall'] * 1e3:5.1f} ms; CPU main "
                      f"{split['main'] * 1e3:5.1f}, mcrdl progress thread "
                      f"{split['progress'] * 1e3:4.1f}, other threads {split['other'] * 1e3:4.1f}"
                      f" ms (CPU / wall {busy / split['wall']:.2f})")
        print(f"step ratio mcrdl / {other_name}: {steps['mcrdl'] / steps['gloo']:.2f} (target "
              f"{'<= 1.05' if cuda else '<= 0.7 at 2 ranks'})")
        print(f"4-byte dist.all_reduce over mcrdl: {statistics.median(c) * 1e6:.1f} µs; "
              f"comm.allreduce().wait(): {statistics.median(d) * 1e6:.1f} µs; adapter "
              f"+{(statistics.median(c) - statistics.median(d)) * 1e6:.1f} µs (target < 10)")
        print(f"  of which the group's own allreduce([t], opts).wait(): "
              f"+{(statistics.median(g) - statistics.median(h)) * 1e6:.1f} µs, torch's "
              f"dist.all_reduce around it the rest")
        print(f"4-byte dist.all_reduce, mcrdl / {other_name}: "
              f"{statistics.median(e) / statistics.median(f):.3f} "
              f"({statistics.median(e) * 1e6:.1f} µs against {statistics.median(f) * 1e6:.1f})"
              f"{' (target <= 1.3)' if cuda else ''}")
        if large is not None:
            a, b = (statistics.median(t) for t in large)
            print(f"64 MiB dist.all_reduce, mcrdl / nccl: {a / b:.3f} ({a * 1e3:.2f} ms "
                  f"against {b * 1e3:.2f}; target <= 1.05)")
    dist.destroy_process_group()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
