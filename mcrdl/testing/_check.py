"""Checking a user's own step: run it as it is on simulated ranks, under many timings.

`check_step` runs the step a program runs on every rank -- a plain function, or an ``async
def`` with tasks of its own -- in simulated worlds of several sizes, under several seeds (each
a different interleaving of the ranks and different completion times) and several backend
semantics (what MPI's independent progress allows, and what NCCL's in-order streams allow),
all in one process and deterministically: a failure replays exactly from its size, semantics
and seed. What it finds is a `StepFailed` naming those, with the simulated world's own
verdict as its ``error``: a `SimDeadlock` (what every rank waits for, and which ranks, peers
and tags an operation still lacks), a `SimMismatch` (members issued different operations at
one position), a `DesyncError` (a named operation the members submitted differently, or
lacked), or what the step itself raised.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ._world import SimWorld

if TYPE_CHECKING:
    from ..front._communicator import Communicator

__all__ = ["SEMANTICS", "StepFailed", "check_step"]

#: Backend semantics to check a step under, by name: ``"mpi"`` as the real backends behave
#: (MPI's nonblocking calls progress independently, with one collective in flight per
#: communicator; gloo's too); ``"nccl"``: every lane runs its operations in order, one at a
#: time, each waiting for every member's to reach the head of its stream (what a program
#: would meet on NCCL); ``"blocking"``: each call returns only once every member made it.
SEMANTICS: Mapping[str, Mapping[str, str]] = {
    "mpi": {"mpi": "windowed", "gloo": "mpi"},
    "nccl": {"mpi": "nccl", "gloo": "nccl"},
    "blocking": {"mpi": "blocking", "gloo": "blocking"},
}


class StepFailed(AssertionError):
    """A step failed in a simulated world: ``size`` ranks, ``semantics`` (a name of
    `SEMANTICS`), ``seed``; ``error`` is what the world or the step raised.

    ``SimWorld(size, SEMANTICS[semantics], seed=seed).run(...)`` replays it exactly.
    """

    def __init__(self, size: int, semantics: str, seed: int, error: BaseException) -> None:
        self.size, self.semantics, self.seed, self.error = size, semantics, seed, error
        super().__init__(
            f"the step failed on {size} simulated ranks, {semantics!r} semantics, seed "
            f"{seed}: {type(error).__name__}: {error}")


def check_step(step: Callable[[Communicator], Any], *, sizes: Iterable[int] = (2, 4),
               seeds: Iterable[int] = range(10), semantics: Collection[str] = ("mpi", "nccl"),
               check: Callable[[list[Any], int], None] | None = None,
               **world_args: Any) -> None:
    """Run ``step(comm)`` on every rank of simulated worlds; raise on the first failure.

    Args:
        step: what each rank runs, given its world communicator: a function, or an ``async
            def`` (a coroutine it returns runs with ``asyncio.run`` on its rank, its tasks
            and all). It may split
            the communicator, and use any operation and backend (``"mpi"`` and ``"gloo"``
            exist in the simulated world).
        sizes: world sizes to run.
        seeds: seeds to run at each size and semantics.
        semantics: names of `SEMANTICS`.
        check: ``check(results, size)`` judges the ranks' return values (in rank order) of
            one run, raising (an AssertionError) where they are wrong.
        world_args: more arguments of `SimWorld` (``debug=True``, ``timeout=...``,
            ``max_delay=...``).

    Raises:
        StepFailed: naming the size, semantics and seed of the first run that failed, with
            its error.
        ValueError: an unknown semantics.
    """
    unknown = [s for s in semantics if s not in SEMANTICS]
    if unknown:
        raise ValueError(f"semantics {unknown} unknown; choose among {sorted(SEMANTICS)}")
    run = _runner(step)
    seeds = list(seeds)
    for size in sizes:
        for name in semantics:
            for seed in seeds:
                world = SimWorld(size, SEMANTICS[name], seed=seed, **world_args)
                try:
                    results = world.run(run)
                    if check is not None:
                        check(results, size)
                except Exception as exc:  # noqa: BLE001 - reported with where it happened
                    raise StepFailed(size, name, seed, exc) from exc


def _runner(step: Callable[[Communicator], Any]) -> Callable[[Communicator], Any]:
    """``step`` as a rank's program: a coroutine it returns runs in an event loop of its
    own."""
    def run(comm: Communicator) -> Any:
        out = step(comm)
        return asyncio.run(out) if inspect.iscoroutine(out) else out

    return run
