"""The training examples' step time with mcrdl (auto, each backend, overlap on and off) and
with plain torch.distributed (gloo) doing the same communication, and the overlap achieved.

    mpiexec -n 2 python benchmarks/workloads.py [--steps 30] [--rounds 3]   (and -n 4)

Each example (examples/data_parallel.py, moe.py, dlrm.py) trains through a communicator it
is handed, so the same step runs over:

- mcrdl's communicator, ``--backend`` auto, mpi, gloo and mix, overlap on; auto, overlap off;
- ``TorchComm``: torch.distributed's gloo group with the same calls (``async_op=True``,
  ``Work.wait()``). torch.distributed has no asyncio integration: an ``await`` there blocks
  until the work is done, so the MoE's micro-batches run one after another;
- ``Loopback``: every operation returns its input at once (the shapes stay right): the step's
  compute alone;
- the step's operations alone, recorded from one step over mcrdl (auto) and replayed without
  compute: submitted in the same order, all in flight at once, then waited for.

Variants alternate in rounds (``--rounds``) of ``--steps`` steps, the first 2 steps of each
not counted; per variant, the median over the slowest rank. Printed per example: step time,
speed-up against torch.distributed, for auto the share of hideable communication that was
hidden, (compute alone + communication alone - step) / min(compute alone, communication
alone), and for every variant the process's CPU time per wall second (the largest rank's):
with one core per rank (2 ranks on 2 cores), communication that is CPU work on the rank
itself -- MPI moves data inside the caller's polls -- cannot hide behind compute on that
core; only its waiting can. Targets (2 ranks): mcrdl at least 2x faster than
torch.distributed per step; overlap hiding at least half in data_parallel and moe.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import data_parallel  # noqa: E402
import dlrm  # noqa: E402
import moe  # noqa: E402
from common import timed  # noqa: E402

import mcrdl  # noqa: E402

EXAMPLES: dict[str, Callable[[Any, str, int, bool], tuple[Any, Any]]] = {
    "data_parallel": lambda c, b, s, o: data_parallel.train(c, "mcrdl", b, s, o),
    "moe": moe.train,
    "dlrm": dlrm.train,
}


class Done:
    """A finished operation: its value at once, waited or awaited."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.value
        yield  # a generator that never suspends


class _Shim:
    """What the examples read of a communicator besides its operations."""

    runtime = None  # no engine: the examples' reports count no operations

    def __init__(self, comm: mcrdl.Communicator) -> None:
        self.rank, self.size, self.backends = comm.rank, comm.size, comm.backends


class Loopback(_Shim):
    """Every operation returns its input: the examples' compute alone."""

    def allreduce(self, buf: Any, op: Any = None, **kw: Any) -> Done:
        return Done(buf)

    def alltoall(self, buf: Any, **kw: Any) -> Done:
        return Done(buf)

    def alltoallv(self, buf: Any, send: Any, recv: Any = None, **kw: Any) -> Done:
        return Done(buf)


class TorchWork:
    """A torch.distributed Work and the tensor it fills."""

    def __init__(self, work: Any, value: Any) -> None:
        self.work, self.value = work, value

    def wait(self) -> Any:
        self.work.wait()
        return self.value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait()  # blocks: torch.distributed has no asyncio integration
        yield


class TorchComm(_Shim):
    """The examples' calls over a torch.distributed process group."""

    def __init__(self, comm: mcrdl.Communicator, group: Any) -> None:
        super().__init__(comm)
        self.group = group

    def allreduce(self, buf: Any, op: Any = mcrdl.ReduceOp.SUM, **kw: Any) -> TorchWork:
        red = dist.ReduceOp.AVG if op is mcrdl.ReduceOp.AVG else dist.ReduceOp.SUM
        return TorchWork(dist.all_reduce(buf, red, group=self.group, async_op=True), buf)

    def alltoall(self, buf: Any, **kw: Any) -> TorchWork:
        out = torch.empty_like(buf)
        return TorchWork(dist.all_to_all_single(out, buf.contiguous(), group=self.group,
                                                async_op=True), out)

    def alltoallv(self, buf: Any, send: Any, recv: Any = None, **kw: Any) -> TorchWork:
        out = buf.new_empty((sum(recv), *buf.shape[1:]))
        return TorchWork(dist.all_to_all_single(out, buf.contiguous(), list(recv), list(send),
                                                group=self.group, async_op=True), out)


class Recorder(_Shim):
    """Passes every operation to mcrdl and notes it, to replay a step's communication."""

    def __init__(self, comm: mcrdl.Communicator) -> None:
        super().__init__(comm)
        self.comm = comm
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, kind: str) -> Callable[..., Any]:
        def call(buf: Any, *args: Any, **kw: Any) -> Any:
            self.ops.append((kind, (buf.shape, buf.dtype, *args), kw))
            return getattr(self.comm, kind)(buf, *args, **kw)
        return call

    def replay(self, comm: mcrdl.Communicator, step: int) -> None:
        """The noted operations on fresh buffers, all submitted, then waited for."""
        futs = []
        for kind, (shape, dtype, *args), kw in self.ops:
            kw = dict(kw)
            if kw.get("name"):
                kw["name"] = f"replay{step}/{kw['name']}"
            futs.append(getattr(comm, kind)(torch.zeros(shape, dtype=dtype), *args, **kw))
        for fut in futs:
            fut.wait()


def _median_slowest(comm: mcrdl.Communicator, times: list[float]) -> float:
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    comm.allreduce(t, mcrdl.ReduceOp.MAX).wait()
    return t.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    comm = mcrdl.init()
    store = dist.PrefixStore("workloads/gloo", comm.runtime.bootstrap.store())
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
    torch_comm = TorchComm(comm, dist.group.WORLD)
    backends = ["auto", *comm.backends] + (["mix"] if {"mpi", "gloo"} <= set(comm.backends)
                                          else [])
    if comm.rank == 0:
        print(f"# training examples, {comm.size} ranks, {args.rounds} rounds of {args.steps} "
              f"steps per variant (first 2 of each not counted), median of the slowest rank")
    for name in args.examples.split(","):
        train = EXAMPLES[name]
        recorder = Recorder(comm)
        train(recorder, "auto", 1, True)
        replays = itertools.count()  # each replay's names are its own

        def communication(steps: int) -> list[float]:
            return timed(lambda: recorder.replay(comm, next(replays)), steps,
                         lambda: comm.barrier().wait())

        variants: dict[str, Callable[[int], list[float]]] = {
            f"mcrdl {b}": (lambda s, b=b: train(comm, b, s, True)[1].times) for b in backends}
        variants["mcrdl auto, overlap off"] = lambda s: train(comm, "auto", s, False)[1].times
        variants["torch.distributed gloo"] = lambda s: train(torch_comm, "gloo", s, True)[1].times
        variants["compute alone"] = lambda s: train(Loopback(comm), "auto", s, True)[1].times
        variants["communication alone"] = communication
        times: dict[str, list[float]] = {v: [] for v in variants}
        cpu = dict.fromkeys(variants, 0.0)  # this process's CPU seconds, per wall second
        for _ in range(args.rounds):
            for v, run in variants.items():
                comm.barrier().wait()
                wall, used = time.perf_counter(), time.process_time()
                times[v] += run(args.steps + 2)[2:]
                cpu[v] += (time.process_time() - used) / (time.perf_counter() - wall)
        med = {v: _median_slowest(comm, t) for v, t in times.items()}
        busy = {v: _median_slowest(comm, [c / args.rounds]) for v, c in cpu.items()}
        if comm.rank == 0:
            torch_t = med["torch.distributed gloo"]
            compute, alone = med["compute alone"], med["communication alone"]
            print(f"\n{name}: compute alone {compute * 1e3:.2f} ms, communication alone "
                  f"{alone * 1e3:.2f} ms ({len(recorder.ops)} operations per step, "
                  f"{busy['communication alone']:.2f} of it on this process's CPU)")
            print(f"{'variant':<26} {'step ms':>8} {'torch/this':>11} {'hidden':>7} "
                  f"{'CPU/wall':>9}")
            for v in variants:
                if v in ("compute alone", "communication alone"):
                    continue
                hidden = ""
                if v.startswith("mcrdl auto"):
                    hidden = f"{(compute + alone - med[v]) / min(compute, alone):7.2f}"
                print(f"{v:<26} {med[v] * 1e3:8.2f} {torch_t / med[v]:11.2f} {hidden:>7} "
                      f"{busy[v]:9.2f}")
    dist.destroy_process_group()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
