"""Checking mcrdl's promises: a deterministic simulated world, and property tests over it.

- `SimWorld`: N simulated ranks in one process, each with a real runtime (engine, lanes,
  DAG) over simulated backends with MPI-like, NCCL-like or blocking matching semantics,
  scheduled deterministically from a seed.
- `programs()`: a hypothesis strategy of well-formed multi-rank programs, optionally with
  `Fault`s (one rank's operation cancelled, failing, or depending on one that fails, or the
  rank dying: `DEATH`); `check_program` runs one in a simulated world and compares every
  rank's buffers with the sequential `reference` (after a death, the survivors also shrink
  the world and reduce over it); `run_program` runs one on real communicators, and
  `check_slots` judges a rank's result there.
- `check_step`: a program's own step (a function, or an ``async def`` with its tasks), run
  as it is on simulated ranks of several sizes, under many seeds and backend semantics;
  `StepFailed` names the first run that deadlocked, mismatched or raised.
- `record` / `replay_ranks`: capture what each rank submits and waits for in a real step
  (a step that hung too), and replay every rank's recording on its rank in the simulated
  world under many timings; `replay`: one rank's recording, SPMD on any number of ranks,
  under many backend assignments, checked against the reference.

Example::

    from mcrdl.testing import check_step

    def test_my_step_never_deadlocks():
        check_step(my_step, sizes=(2, 4), seeds=range(20), semantics=("mpi", "nccl"))
"""

from __future__ import annotations

from typing import Any

from ._check import SEMANTICS, StepFailed, check_step
from ._device import SimArray, SimDevice
from ._generate import programs
from ._programs import DEATH, DONE, FAULTS, KINDS, Fault, Program, Region, Step, run_program
from ._record import Recording, record, replay, replay_ranks
from ._reference import reference, reference_with_faults
from ._world import SimAborted, SimDeadlock, SimMismatch, SimWorld

__all__ = ["DEATH", "FAULTS", "FAULT_ERRORS", "KINDS", "SEMANTICS", "Fault", "Program", "Recording",
           "Region", "SimAborted", "SimArray", "SimDeadlock", "SimDevice", "SimMismatch",
           "SimWorld", "Step", "StepFailed", "check_outcomes", "check_program", "check_slots",
           "check_step", "programs", "record", "reference", "reference_with_faults", "replay",
           "replay_ranks",
           "run_program"]

#: How a step may end under injected faults: the fault itself (cancelled, its start or its
#: backend failing, a dependency failing) or its consequence (the communicator broken, by a
#: member's death too). Never a timeout: every member must learn of a break from the
#: breaking rank, and of a death from the launcher.
FAULT_ERRORS = frozenset({"FutureCancelledError", "DependencyFailedError", "BackendError",
                          "StartError", "CommBrokenError", "PeerLostError"})
#: The per-operation timeout of simulated runs with faults (simulated seconds): a hang
#: becomes a CommTimeoutError, so that what completed can still be judged.
FAULT_TIMEOUT = 5.0


def check_slots(program: Program, rank: int, got: list[Any],
                outcomes: list[dict[int, str]] | None = None) -> None:
    """Judge rank ``rank``'s final slots ``got`` against the sequential reference.

    Without faults every element must match. With them, ``outcomes`` (every rank's, from
    ``run_program``) says which steps failed where; then every element that a correct runtime
    must have right (see ``reference_with_faults``) must match.

    Raises:
        AssertionError: a wrong element (naming rank, slot and index).
        ValueError: ``got`` has more or fewer slots than the program.
    """
    import numpy as np

    if outcomes is None:
        want, defined = reference(program)[rank], None
    else:
        states, masks = reference_with_faults(program, outcomes)
        want, defined = states[rank], masks[rank]
    for slot, (a, b) in enumerate(zip(got, want, strict=True)):
        mask = np.ones(len(b), dtype=bool) if defined is None else defined[slot]
        wrong = np.flatnonzero(mask & (a != b))
        if wrong.size:
            i = int(wrong[0])
            raise AssertionError(
                f"rank {rank} slot {slot}: element {i} is {a[i]!r}, the reference says "
                f"{b[i]!r} ({wrong.size} wrong)\n  got      {a.tolist()}\n  expected "
                f"{b.tolist()}\n  checked  {mask.astype(int).tolist()}")


def check_outcomes(program: Program, rank: int, outcomes: list[dict[int, str]]) -> None:
    """Under faults: every step rank ``rank`` took part in ended well, or with one of
    `FAULT_ERRORS` (never a timeout: its peers must have been told).

    Raises:
        AssertionError: naming the step and how it ended.
    """
    for step, how in sorted(outcomes[rank].items()):
        if how != DONE and how not in FAULT_ERRORS:
            raise AssertionError(f"rank {rank} step {step} ({program.steps[step].kind}) "
                                 f"ended with {how}: {sorted(FAULT_ERRORS)} expected")


def check_program(program: Program, *, seed: int = 0, backends: dict[str, str] | None = None,
                  **world_args: Any) -> SimWorld:
    """Run ``program`` in a simulated world and judge every rank's slots (`check_slots`).

    Raises:
        SimDeadlock, SimMismatch: the run hung or desynchronized.
        AssertionError: a rank's result differs from the sequential reference, or a step
            ended with an error its faults do not explain.
    """
    import numpy as np

    sems = backends or {name: "mpi" for name in program.backends}
    if program.faults:
        world_args.setdefault("timeout", FAULT_TIMEOUT)
    if program.device:
        world_args.setdefault("device", True)
    world = SimWorld(program.size, sems, seed=seed, **world_args)
    outcomes: list[dict[int, str]] | None = (
        [{} for _ in range(program.size)] if program.faults else None)
    dead = {f.rank for f in program.faults if f.kind == DEATH}

    def rank_program(comm: Any) -> tuple[list[Any], Any]:
        slots = run_program(program, comm, pause=world.sleep,
                            outcomes=None if outcomes is None else outcomes[comm.rank],
                            inject=world.inject, kill=world.kill)
        if not dead:
            return slots, None
        # The survivors go on: they agree on who is alive, and reduce over themselves.
        survivors = comm.shrink()
        total = survivors.allreduce(np.array([float(comm.rank)])).wait()
        return slots, (list(survivors.members), total.tolist())

    got = world.run(rank_program)
    live = [r for r in range(program.size) if r not in dead]
    for rank in live:  # wrong data first: it says more than a timeout
        check_slots(program, rank, got[rank][0], outcomes)
    for rank in live if outcomes is not None else ():
        check_outcomes(program, rank, outcomes)  # type: ignore[arg-type]
    for rank in live if dead else ():
        if got[rank][1] != (live, [float(sum(live))]):
            raise AssertionError(f"rank {rank}: after the death of {sorted(dead)}, the "
                                 f"survivors' world and sum are {got[rank][1]}, not "
                                 f"{(live, [float(sum(live))])}")
    return world
