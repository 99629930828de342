"""The property harness on the real backends: generated programs on mpi + gloo, every rank.

Hypothesis runs derandomized and without shrinking, so that every rank draws the same
programs in the same order; integer dtypes keep every result exact whatever order a backend
reduces in.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from mpi4py import MPI

from mcrdl import ReduceOp
from mcrdl.testing import check_slots, programs, run_program

REAL = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def test_generated_programs_match_the_reference(comm):
    @REAL
    @given(programs(min_size=comm.size, max_size=comm.size, backends=("mpi", "gloo"),
                    dtypes=("int32", "int64"), ops=(ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX),
                    max_steps=10))
    def check(program):
        verdict = None
        try:
            check_slots(program, comm.rank, run_program(program, comm))
        except Exception as exc:  # noqa: BLE001 - agreed on below, with every rank's
            verdict = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
        # Every rank fails the example, or none does: hypothesis replays a failing example,
        # and a rank replaying alone would wait for the others in the next collective.
        verdicts = [v for v in MPI.COMM_WORLD.allgather(verdict) if v is not None]
        assert not verdicts, "\n".join(verdicts)

    check()
