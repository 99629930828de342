"""What the workload examples share: their command line, their report and their plot."""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import mcrdl

#: ``--backend mix``: each kind of operation on the backend that suits it on one node
#: (alltoalls on gloo, allreduces on mpi), to show two backends in one step.
MIX = {"alltoall": "gloo", "alltoallv": "gloo", "allreduce": "mpi"}


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The options every example takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", default="auto",
                   help="auto (mcrdl picks per operation), mpi, gloo, or mix (alltoalls on "
                        "gloo, allreduces on mpi)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--plot", metavar="PNG", help="write the loss curve and the step times")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="wait for each operation at once instead of overlapping it")
    return p


def backend_for(comm: mcrdl.Communicator, choice: str, kind: str) -> str:
    """The backend an operation of ``kind`` runs on under ``--backend choice``."""
    if choice != "mix":
        return choice
    missing = {MIX[kind]} - set(comm.backends)
    if missing:
        raise SystemExit(f"--backend mix needs {sorted(missing)}, which is not up here "
                         f"(up: {', '.join(comm.backends)})")
    return MIX[kind]


class Run:
    """One training run's records: per step its loss, its time and the time spent waiting
    for communication (``waiting``: what that time is); per backend and kind, the operations
    that ran on it."""

    def __init__(self, comm: mcrdl.Communicator, waiting: str = "waiting for communication"
                 ) -> None:
        self.waiting = waiting
        self.losses: list[float] = []
        self.times: list[float] = []
        self.waits: list[float] = []
        self.ops: Counter[str] = Counter()
        runtime = comm.runtime  # None for a stand-in (benchmarks/workloads.py): nothing counted
        self._stop = runtime.engine.observe(self._count) if runtime else lambda: None

    def _count(self, fut: Any, _after: Any) -> None:
        kind = getattr(fut.kind, "value", fut.kind)
        if kind != "fingerprint":  # debug mode's checks are not the program's operations
            self.ops[f"{kind} on {fut.lane.backend_name}"] += 1

    def record(self, loss: float, seconds: float, waited: float) -> None:
        self.losses.append(loss)
        self.times.append(seconds)
        self.waits.append(waited)

    def close(self) -> None:
        """Stop counting operations."""
        self._stop()

    def report(self, title: str) -> str:
        """A few readable lines: loss, step time, waiting, operations per backend."""
        skip = min(2, len(self.times) - 1)  # the first steps warm up
        step = statistics.median(self.times[skip:])
        wait = statistics.median(self.waits[skip:])
        waiting = ("waiting not visible (inside torch)" if math.isnan(wait)
                   else f"of which {self.waiting} {wait * 1e3:.2f} ms")
        ops = ", ".join(f"{k}: {v}" for k, v in sorted(self.ops.items()))
        return (f"{title}\n"
                f"  loss (rank 0's share of the batch) {self.losses[0]:.5f} -> "
                f"{self.losses[-1]:.5f} over {len(self.losses)} steps\n"
                f"  step {step * 1e3:.2f} ms (median), {waiting}\n"
                f"  operations: {ops}")

    def plot(self, path: str, title: str) -> None:
        """A PNG: the loss per step, and each step's time split into waiting and the rest."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
        left.plot(self.losses)
        left.set_xlabel("step")
        left.set_ylabel("loss")
        left.set_yscale("log")
        steps = range(len(self.times))
        waits = [0.0 if math.isnan(w) else w for w in self.waits]
        busy = [(t - w) * 1e3 for t, w in zip(self.times, waits)]
        right.bar(steps, busy, width=1.0, label="the rest")
        right.bar(steps, [w * 1e3 for w in waits], bottom=busy, width=1.0, label=self.waiting)
        right.set_ylim(0, 3e3 * statistics.median(self.times))  # the first steps warm up
        right.set_xlabel("step")
        right.set_ylabel("ms (first steps cut off)")
        right.legend()
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def show(comm: mcrdl.Communicator, run: Run, args: argparse.Namespace, what: str) -> None:
    """Rank 0 prints the run's report (and writes its plot with ``--plot``)."""
    if comm.rank == 0:
        title = (f"{what}, backend {args.backend}, overlap {'on' if args.overlap else 'off'}")
        print(run.report(title))
        if args.plot:
            run.plot(args.plot, title)


def main(doc: str, train: Callable[[mcrdl.Communicator, str, int, bool], tuple[Any, Run]],
         describe: Callable[[mcrdl.Communicator], str], steps: int = 300) -> None:
    """An example's command: parse its options, bring mcrdl up, train, report."""
    args = parser(doc.splitlines()[0], steps).parse_args()
    torch.set_num_threads(1)
    comm = mcrdl.init()
    _, run = train(comm, args.backend, args.steps, args.overlap)
    show(comm, run, args, describe(comm))
    mcrdl.finalize()
