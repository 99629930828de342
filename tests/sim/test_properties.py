"""The no-deadlock guarantee, as properties over generated well-formed programs (simulated).

Every generated program (2-8 ranks, split communicators, every operation, buffer reuse across
backends, after= edges, per-rank delays and wait orders) must complete, and every rank's
buffers must equal the sequential numpy reference; a mismatch of collective order on any lane
fails the run on the spot (SimMismatch). tests/sim/test_policies.py shows these same checks
failing for broken policies.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcrdl.testing import check_program, programs

from . import examples

FAST = settings(max_examples=examples(300), deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
MIXED = settings(max_examples=examples(100), deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))

SEMANTICS = {"mpi": "windowed", "gloo": "mpi", "nccl": "nccl", "blk": "blocking"}


@FAST
@given(programs(backends=("mpi", "gloo")), st.integers(0, 2**16))
def test_mpi_like_backends_never_deadlock_and_match_the_reference(program, seed):
    check_program(program, seed=seed, backends={"mpi": "windowed", "gloo": "mpi"})


@MIXED
@given(programs(backends=tuple(SEMANTICS)), st.integers(0, 2**16))
def test_mixed_semantics_never_deadlock_and_match_the_reference(program, seed):
    """MPI-like, NCCL-like (a stream per lane) and blocking (a thread per lane) together."""
    check_program(program, seed=seed, backends=SEMANTICS)
