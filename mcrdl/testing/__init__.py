"""Checking mcrdl's promises: a deterministic simulated world, and property tests over it.

- `SimWorld`: N simulated ranks in one process, each with a real runtime (engine, lanes,
  DAG) over simulated backends with MPI-like, NCCL-like or blocking matching semantics,
  scheduled deterministically from a seed.
"""

from ._programs import KINDS, Program, Region, Step, programs, reference, run_program
from ._world import SimAborted, SimDeadlock, SimMismatch, SimWorld

__all__ = ["KINDS", "Program", "Region", "SimAborted", "SimDeadlock", "SimMismatch", "SimWorld",
           "Step", "check_program", "programs", "reference", "run_program"]


def check_program(program: Program, *, seed: int = 0, backends: dict[str, str] | None = None,
                  **world_args: object) -> SimWorld:
    """Run ``program`` in a simulated world and compare every rank's slots with the reference.

    Raises:
        SimDeadlock, SimMismatch: the run hung or desynchronized.
        AssertionError: a rank's result differs from the sequential reference.
    """
    import numpy as np

    sems = backends or {name: "mpi" for name in program.backends}
    world = SimWorld(program.size, sems, seed=seed, **world_args)  # type: ignore[arg-type]
    got = world.run(lambda comm: run_program(program, comm, pause=world.sleep))
    want = reference(program)
    for rank, (g, w) in enumerate(zip(got, want)):
        for slot, (a, b) in enumerate(zip(g, w)):
            if not np.array_equal(a, b):
                raise AssertionError(
                    f"rank {rank} slot {slot}: got {a.tolist()}\n  expected {b.tolist()}")
    return world
