"""What naming collectives costs (rule 8: matched by name in an order the members agree on).

    mpiexec -n 2 python benchmarks/named.py [--backend mpi] [--sizes 4,64K,4M] [--inflight 1,8,64]
                                            [--loop asyncio|uvloop] [--fusion on|off] [--phases]

A *step* submits ``k`` allreduces of one size, and waits for them all: in mode ``tasks`` each
from an asyncio task of its own (the way gradient buckets or pipeline micro-batches run), in
mode ``loop`` from a plain loop that then waits on each (a training loop's bucket hooks).
Unnamed, the tasks are
created in one order on every rank and submit before their first await, so that the order is
the same everywhere (the well-formed baseline); named, each task passes ``name=`` and the
ranks agree on the order. Steps alternate named and unnamed (``common.alternate``) after a
warm-up that fills the response cache, so this is the steady state: each step's agreement
costs one or two small rounds whatever ``k`` is.

Prints, per size and ``k``: the median step time divided by ``k`` (per operation) unnamed and
named, their ratio, and the agreement rounds per named step (rank 0). Targets (from the
issue): ratio <= 1.5 at 4 B with 64 in flight, <= 1.05 from 64 KiB on.

In mode ``tasks`` two last columns time what any agreement adds to unnamed tasks, as ratios
to plain unnamed ones (alternated the same way). A member can issue a named operation only
once it knows that every member has submitted it, which the others do from tasks of their
own. Either the task waits for that in a later step, after it yields to its loop (``a step
more``: unnamed tasks that yield once between their submission and their await), or it
learns it within its first step, by a round of its own (``a round each``: unnamed tasks that
first run a raw mpi4py ``Allgather`` of 8 bytes, the least such a round costs). The lower of
the two is a floor under the named ratio of that row for any way of agreeing.

In mode ``loop`` the last column (``a round a step``) times unnamed steps with a raw mpi4py
``Allgather`` of 8 bytes between the submissions and the waits: the least one agreement a
step adds, with nothing a name costs per operation. The named ratio's excess over it is the
engine's own cost of naming (its checks, its bookkeeping, its placing), which a faster
engine could shrink; the floors of mode ``tasks`` no engine can go under.

``--phases`` also times the steps, named and unnamed alternately, each after a barrier, on
every rank (medians, µs from the step's start): its last submission, its first operation's
issue, its last operation's end, and its return. Unnamed operations are issued as they are
submitted (as MPI's window of one collective in flight allows), so they drain while the
others are submitted; named ones wait for a round, which waits for every rank's last
submission.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, human, parse_sizes  # noqa: E402

import mcrdl  # noqa: E402


def _steps(size: int, k: int) -> int:
    return max(40, min(400, (64 << 20) // max(1, size * k * 8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--sizes", default="4,64K,4M")
    parser.add_argument("--inflight", default="1,8,64")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the event loop of mode tasks")
    parser.add_argument("--fusion", choices=("on", "off"), default="on",
                        help="off: init(fusion_bytes=0), no named allreduce fused with others "
                             "(engine._fusion), to see what fusion contributes")
    parser.add_argument("--phases", action="store_true",
                        help="also time each step's phases on every rank (docstring)")
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    ks = [int(k) for k in args.inflight.split(",")]
    comm = mcrdl.init(fusion_bytes=0 if args.fusion == "off" else None)
    backend = args.backend
    if args.loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    from mpi4py import MPI

    raw = MPI.COMM_WORLD.Dup()  # the rounds of columns "a round each" and "a round a step"
    row, table = bytearray(8), bytearray(8 * comm.size)
    rows = []
    phase_rows = []
    for size in sizes:
        for k in ks:
            bufs = [torch.zeros(max(1, size // 4)) for _ in range(k)]
            names = [f"bucket{i}" for i in range(k)]

            async def one(i: int, named: bool) -> None:
                await comm.allreduce(bufs[i], backend=backend,
                                     name=names[i] if named else None)

            async def one_step_more(i: int) -> None:
                fut = comm.allreduce(bufs[i], backend=backend)
                await asyncio.sleep(0)
                await fut

            async def one_round_more(i: int) -> None:
                raw.Allgather(row, table)  # the least an agreement of its own would cost
                await comm.allreduce(bufs[i], backend=backend)

            futs: list[mcrdl.CommFuture] = []

            async def kept(i: int, named: bool) -> None:
                fut = comm.allreduce(bufs[i], backend=backend, name=names[i] if named else None)
                futs.append(fut)
                await fut

            def tasks(body):
                """A step of mode tasks: ``body(i)`` as a task of its own for each i."""
                async def step() -> None:
                    await asyncio.gather(*(body(i) for i in range(k)))

                return lambda: loop.run_until_complete(step())

            def loop_step(named: bool, round_first: bool = False) -> None:
                futs[:] = [comm.allreduce(bufs[i], backend=backend,
                                          name=names[i] if named else None) for i in range(k)]
                if round_first:
                    raw.Allgather(row, table)  # the least one agreement a step costs
                for fut in futs:
                    fut.wait()

            modes = {
                "tasks": (tasks(lambda i: one(i, False)), tasks(lambda i: one(i, True))),
                "loop": (lambda: loop_step(False), lambda: loop_step(True)),
            }
            for mode, (unnamed, named) in modes.items():
                for _ in range(5):
                    named()
                    unnamed()
                comm.barrier(backend="mpi").wait()
                rounds0 = comm._names.rounds
                iters = _steps(size, k)
                a, b = alternate(unnamed, named, iters)
                rounds = (comm._names.rounds - rounds0) / iters
                ua, nb = statistics.median(a) / k, statistics.median(b) / k
                # unnamed, with what any agreement adds (docstring)
                bodies = ((tasks(one_step_more), tasks(one_round_more)) if mode == "tasks"
                          else (lambda: loop_step(False, round_first=True),))
                floors = []
                for body in bodies:
                    a2, b2 = alternate(unnamed, body, iters)
                    floors.append(statistics.median(b2) / statistics.median(a2))
                rows.append((mode, size, k, ua, nb, rounds, floors))
                if args.phases:
                    steps = {"tasks": (tasks(lambda i: kept(i, False)),
                                       tasks(lambda i: kept(i, True))),
                             "loop": modes["loop"]}[mode]
                    phase_rows.append((mode, size, k, _phases(comm, raw, steps, futs, iters)))
    rank = comm.rank
    size_w = comm.size
    raw.Free()
    mcrdl.finalize()
    if rank:
        return
    print(f"# named vs unnamed allreduce on {backend}, {size_w} ranks, tasks on {args.loop}, "
          f"fusion {args.fusion} (median per operation, rank 0)")
    print(f"{'mode':<5} {'size':>6} {'in flight':>9} | {'unnamed µs':>10} {'named µs':>10} "
          f"{'ratio':>6} {'rounds/step':>11} | {'a step more':>11} {'a round each':>12} "
          f"{'a round a step':>14}")
    for mode, size, k, ua, nb, rounds, floors in rows:
        cells = [f"{f:.2f}" for f in floors]
        more, each, once = [*cells, "-"] if mode == "tasks" else ["-", "-", *cells]
        print(f"{mode:<5} {human(size):>6} {k:>9} | {ua * 1e6:10.2f} {nb * 1e6:10.2f} "
              f"{nb / ua:6.2f} {rounds:11.2f} | {more:>11} {each:>12} {once:>14}")
    if phase_rows:
        print("\n# each step's phases, each rank's medians, µs from the step's start: last "
              "submission, first issue, last end, return; the returns' ratio")
        print(f"{'mode':<5} {'size':>6} {'in flight':>9} {'rank':>4} | {'unnamed':^27} | "
              f"{'named':^27} | {'ratio':>5}")
        for mode, size, k, table_ in phase_rows:
            for r, cells in enumerate(table_):
                u, n = (" ".join(f"{c:6.0f}" for c in half) for half in (cells[:4], cells[4:]))
                print(f"{mode:<5} {human(size):>6} {k:>9} {r:>4} | {u} | {n} | "
                      f"{cells[7] / cells[3]:5.2f}")


def _phases(comm, raw, steps, futs, iters: int):
    """Every rank's median phases of the ``steps`` (unnamed, named), alternated, each after a
    barrier: rows of 8 µs figures, unnamed then named (module docstring)."""
    clock = time.perf_counter
    split: tuple[list[tuple[float, ...]], list[tuple[float, ...]]] = ([], [])

    def step(named: int) -> None:
        futs.clear()
        t0 = clock()
        steps[named]()
        t1 = clock()
        last = max(f.t_submit for f in futs)
        first = min(f.t_issue for f in futs)
        done = max(f.t_done for f in futs)
        split[named].append((last - t0, first - t0, done - t0, t1 - t0))

    alternate(lambda: step(0), lambda: step(1), iters,
              sync=lambda: comm.barrier(backend="mpi").wait())
    mine = np.array([statistics.median(col) * 1e6 for half in split for col in zip(*half)])
    table = np.empty((comm.size, 8))
    raw.Allgather(mine, table)
    return table

if __name__ == "__main__":
    main()
