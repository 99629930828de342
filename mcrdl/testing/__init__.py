"""Checking mcrdl's promises: a deterministic simulated world, and property tests over it.

- `SimWorld`: N simulated ranks in one process, each with a real runtime (engine, lanes,
  DAG) over simulated backends with MPI-like, NCCL-like or blocking matching semantics,
  scheduled deterministically from a seed.
- `programs()`: a hypothesis strategy of well-formed multi-rank programs; `check_program`
  runs one in a simulated world and compares every rank's buffers with the sequential
  `reference`; `run_program` runs one on real communicators.
- `record` / `replay`: capture what a rank submits in a real step, and replay it in the
  simulated world under many timings and backend assignments.

Example::

    from hypothesis import given
    from mcrdl.testing import check_program, programs

    @given(programs(backends=("mpi", "gloo")))
    def test_my_runtime_never_deadlocks(program):
        check_program(program)
"""

from ._programs import KINDS, Program, Region, Step, programs, reference, run_program
from ._record import Recording, record, replay
from ._world import SimAborted, SimDeadlock, SimMismatch, SimWorld

__all__ = ["KINDS", "Program", "Recording", "Region", "SimAborted", "SimDeadlock", "SimMismatch",
           "SimWorld", "Step", "check_program", "programs", "record", "reference", "replay",
           "run_program"]


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
