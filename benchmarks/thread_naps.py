"""The progress thread's longest nap: settings of ``PollPolicy.background_nap_max`` in one run.

    mpiexec -n 2 python benchmarks/thread_naps.py [--naps 1,4] [--rounds 10] [--reps 4]

The background thread polls while work is in flight and nobody waits. When it finds nothing
to poll (nothing in flight, or a caller that drives or keeps submitting) it parks, and each
such park doubles the next, from ``background_max`` (1 ms) to ``background_nap_max``. Each of
its wakes takes the GIL from the caller. The runtime sets 4 ms where the ranks fill the
node's cores and leaves 1 ms (no doubling) elsewhere; this compares settings (``--naps``, in
ms) on this host. Each round restarts the thread with one setting, and the rounds cycle
through the settings, so that the host's drift falls on all alike.

Cases (median µs of the slowest rank, and the ratio to the first setting):
- the training examples' steps (data_parallel, moe, dlrm; auto, overlap on);
- one 4-byte allreduce at a time, per operation;
- 64 allreduces of 4 B, of 64 KiB, and of 64 KiB named, submitted then waited for, per
  operation;
- what longer naps cost: after those 64 small ones, a 1 MiB allreduce submitted, 2 ms of
  torch compute (which releases the GIL), then its wait (the thread polls it meanwhile only
  once it next wakes): compute and wait together.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import data_parallel  # noqa: E402
import dlrm  # noqa: E402
import moe  # noqa: E402

import mcrdl  # noqa: E402
from mcrdl.engine import PollPolicy  # noqa: E402
from mcrdl.engine._drivers import ProgressThread  # noqa: E402

_clock = time.perf_counter


def restart_thread(comm: mcrdl.Communicator, policy: PollPolicy) -> None:
    """Stop the engine's progress thread and start another that follows ``policy``."""
    engine = comm.runtime.engine
    engine._thread.stop()  # type: ignore[union-attr]
    engine._policy = policy
    engine._thread = ProgressThread(engine)


def cases(comm: mcrdl.Communicator) -> dict[str, Callable[[], list[float]]]:
    """Each case: a call returning the seconds it measured."""
    one = torch.zeros(1)
    small = [torch.zeros(1) for _ in range(64)]
    mid = [torch.zeros(16384) for _ in range(64)]
    big = torch.zeros(1 << 18)
    names = [f"bucket{i}" for i in range(64)]
    state = {"m": torch.randn(256, 256)}

    def compute(seconds: float) -> None:
        t0 = _clock()
        while _clock() - t0 < seconds:
            state["m"] = (state["m"] @ state["m"]).clamp_(-1, 1)

    def single() -> list[float]:
        t0 = _clock()
        for _ in range(200):
            comm.allreduce(one, backend="mpi").wait()
        return [(_clock() - t0) / 200]

    def burst(bufs: list[torch.Tensor], named: bool = False) -> list[float]:
        t0 = _clock()
        futs = [comm.allreduce(b, backend="mpi", name=names[i] if named else None)
                for i, b in enumerate(bufs)]
        for fut in futs:
            fut.wait()
        return [(_clock() - t0) / len(bufs)]

    def then_compute() -> list[float]:
        burst(small)
        fut = comm.allreduce(big, backend="mpi")
        t0 = _clock()
        compute(2e-3)
        fut.wait()
        return [_clock() - t0]

    return {
        "data_parallel step": lambda: data_parallel.train(comm, "mcrdl", "auto", 12)[1].times[2:],
        "moe step": lambda: moe.train(comm, "auto", 12)[1].times[2:],
        "dlrm step": lambda: dlrm.train(comm, "auto", 12)[1].times[2:],
        "one 4 B allreduce at a time, per op": single,
        "64 x 4 B, per op": lambda: burst(small),
        "64 x 64 KiB, per op": lambda: burst(mid),
        "64 x 64 KiB named, per op": lambda: burst(mid, True),
        "then 1 MiB over 2 ms of compute": then_compute,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--naps", default="1,4", help="background_nap_max settings, in ms")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per case, all settings")
    parser.add_argument("--reps", type=int, default=4, help="calls of a case per round")
    parser.add_argument("--cases", default=None, help="the cases to run (default: all), by "
                        "the start of their names, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = mcrdl.init()
    engine = comm.runtime.engine
    if engine._thread is None:
        mcrdl.finalize()
        raise SystemExit("the progress thread is off (MCRDL_PROGRESS_THREAD=0): nothing to compare")
    original = engine.policy
    chosen = original.nap_max
    naps = [float(n) * 1e-3 for n in args.naps.split(",")]
    policies = [dataclasses.replace(engine.policy, background_nap_max=n) for n in naps]
    todo = cases(comm)
    if args.cases:
        starts = args.cases.split(",")
        todo = {k: v for k, v in todo.items() if any(k.startswith(s) for s in starts)}
    rows = []
    for name, case in todo.items():
        times: list[list[float]] = [[] for _ in naps]
        for r in range(args.rounds * len(naps)):
            restart_thread(comm, policies[r % len(naps)])
            comm.barrier(backend="mpi").wait()
            for _ in range(args.reps):
                times[r % len(naps)] += case()
        medians = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
        comm.allreduce(medians, mcrdl.ReduceOp.MAX).wait()  # the slowest rank's
        rows.append((name, medians.tolist()))
    restart_thread(comm, original)
    if comm.rank == 0:
        print(f"# progress thread's longest nap, {comm.size} ranks on {os.cpu_count()} cores "
              f"(the runtime chose {chosen * 1e3:g} ms); {args.rounds} rounds of {args.reps} "
              f"per setting; median µs of the slowest rank")
        head = " ".join(f"{f'{n * 1e3:g} ms':>10}" for n in naps)
        ratios = " ".join(f"{f'{n * 1e3:g}/{naps[0] * 1e3:g}':>8}" for n in naps[1:])
        print(f"{'case':<36} {head} {ratios}")
        for name, med in rows:
            cells = " ".join(f"{m * 1e6:10.1f}" for m in med)
            rel = " ".join(f"{m / med[0]:8.3f}" for m in med[1:])
            print(f"{name:<36} {cells} {rel}")
    mcrdl.finalize()


if __name__ == "__main__":
    main()
