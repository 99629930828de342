"""The no-deadlock guarantee, as properties over generated well-formed programs (simulated).

Every generated program (2-8 ranks, split communicators, every operation, buffer reuse across
backends, after= edges, per-rank delays and wait orders) must complete, and every rank's
buffers must equal the sequential numpy reference; a mismatch of collective order on any lane
fails the run on the spot (SimMismatch). tests/sim/test_policies.py shows these same checks
failing for broken policies.

Where random regions almost never meet (several unfinished operations reading the very same
bytes, then one writing over them), a directed property draws exactly that.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcrdl import ReduceOp
from mcrdl.testing import Program, Region, Step, check_program, check_slots, programs, reference

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


@st.composite
def reads_then_a_write(draw):
    """Two or three collectives on the world read one region of slot 0 (each into a slot of
    its own), then an in-place collective writes over part of it; every step on a backend
    drawn freely, and no ``after=`` edges, delays or early waits: only the hazard orders the
    write after every read (the engine keeps several readers of one range together)."""
    size = draw(st.integers(2, 4))
    chunk = draw(st.integers(1, 4))
    read = Region(0, draw(st.integers(0, 8)), size * chunk)
    backends = st.sampled_from(["mpi", "gloo", None])
    outs = {"allgather": size * read.length, "gather": size * read.length,
            "alltoall": read.length, "scatter": chunk, "reduce_scatter": chunk}
    readers = draw(st.integers(2, 3))
    steps = [Step(kind, (0, 0), draw(backends), read, Region(k, 0, outs[kind]),
                  root=draw(st.integers(0, size - 1)), op=ReduceOp.SUM)
             for k, kind in enumerate(draw(st.lists(st.sampled_from(sorted(outs)),
                                                    min_size=readers, max_size=readers)), 1)]
    steps.append(Step(draw(st.sampled_from(["allreduce", "broadcast", "reduce"])), (0, 0),
                      draw(backends),
                      Region(0, draw(st.integers(read.start, read.start + read.length - 1)),
                             draw(st.integers(1, 8))),
                      root=draw(st.integers(0, size - 1)),
                      op=draw(st.sampled_from([ReduceOp.SUM, ReduceOp.MAX]))))
    every = tuple(range(len(steps)))
    return Program(size, (), (("float64", 64),) * (readers + 1), tuple(steps),
                   delays=((0,) * len(steps),) * size, mid_waits=(frozenset(),) * size,
                   waits=tuple(tuple(draw(st.permutations(every))) for _ in range(size)))


@MIXED
@given(reads_then_a_write(), st.integers(0, 2**16))
def test_a_write_waits_for_every_unfinished_read_of_its_bytes(program, seed):
    check_program(program, seed=seed, backends={"mpi": "windowed", "gloo": "mpi"})


def test_the_judge_refuses_slots_it_cannot_compare_one_to_one():
    """``check_slots`` compares every slot: a result with a slot fewer or more is refused,
    not judged on the slots both have."""
    program = Program(2, (), (("int32", 4), ("int32", 4)),
                      (Step("allreduce", (0, 0), "mpi", Region(0, 0, 4), op=ReduceOp.SUM),))
    want = reference(program)[1]
    check_slots(program, 1, want)
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is longer than argument 1$"):
        check_slots(program, 1, want[:1])
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is shorter than argument 1$"):
        check_slots(program, 1, [*want, want[0]])
    wrong = [want[0], want[1] + 1]
    with pytest.raises(AssertionError, match=r"^rank 1 slot 1: element 0 is "):
        check_slots(program, 1, wrong)
