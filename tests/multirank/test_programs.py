"""The property harness on the real backends: generated programs on mpi + gloo, every rank.

Hypothesis runs derandomized and without shrinking, so that every rank draws the same
programs in the same order; integer dtypes keep every result exact whatever order a backend
reduces in.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings

from mcrdl import ReduceOp
from mcrdl.testing import programs, reference, run_program

REAL = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def test_generated_programs_match_the_reference(comm):
    @REAL
    @given(programs(min_size=comm.size, max_size=comm.size, backends=("mpi", "gloo"),
                    dtypes=("int32", "int64"), ops=(ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX),
                    max_steps=10))
    def check(program):
        got = run_program(program, comm)
        want = reference(program)[comm.rank]
        for slot, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), (slot, a.tolist(), b.tolist(), program)

    check()
