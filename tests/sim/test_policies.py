"""The harness can fail: broken policies are caught, and shrunk to a small program.

Each test searches generated programs for one that the broken policy gets wrong (a deadlock,
a desynchronized lane, or a wrong result), lets hypothesis shrink it where shrinking shows
something, and prints the program. A harness that could not find these would prove nothing
about the real policies.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, find, settings

from mcrdl import MCRDLError
from mcrdl.testing import SimDeadlock, SimMismatch, check_program, programs

from .broken import PerRankSelector, ReadyFirstEngine

SEARCH = settings(max_examples=600, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
#: The first failing program, unshrunk, where shrinking has nothing to show: the deadlock of
#: a blocking issue needs a particular interleaving, and its shrinking (two minutes here)
#: left the program as long as it was found.
FIRST = settings(SEARCH, phases=[Phase.generate])


def _fails(program, errors, **world):
    for seed in range(3):
        try:
            check_program(program, seed=seed, **world)
        except errors:
            return True
    return False


def _report(name, program, shrunk=True):
    how = "shrunk to" if shrunk else "found with"
    lines = [f"{name}: {how} {len(program.steps)} step(s) on {program.size} ranks"]
    lines += [f"  {s}" for s in program.steps]
    print("\n".join(lines))


def test_ready_first_issue_is_caught():
    sems = {"mpi": "mpi", "gloo": "mpi"}
    program = find(programs(backends=tuple(sems), auto=False, max_steps=8),
                   lambda p: _fails(p, (SimMismatch, SimDeadlock, AssertionError, MCRDLError),
                                    backends=sems, engine_factory=ReadyFirstEngine),
                   settings=SEARCH)
    _report("ready-first issue", program)
    assert len(program.steps) <= 4
    # the same program passes with the real engine
    check_program(program, seed=0, backends=sems)


def test_per_rank_backend_choice_is_caught():
    sems = {"mpi": "mpi", "gloo": "mpi"}
    program = find(programs(backends=tuple(sems), max_steps=6),
                   lambda p: _fails(p, (SimMismatch, SimDeadlock),
                                    backends=sems, selector_factory=PerRankSelector),
                   settings=SEARCH)
    _report("per-rank backend choice", program)
    assert len(program.steps) <= 2
    check_program(program, seed=0, backends=sems)


def test_blocking_issue_is_caught():
    sems = {"mpi": "mpi", "blk": "blocking"}
    program = find(programs(backends=tuple(sems), auto=False, max_steps=8),
                   lambda p: _fails(p, (SimDeadlock,), backends=sems, wrap_blocking=False),
                   settings=FIRST)
    _report("blocking issue", program, shrunk=False)
    check_program(program, seed=0, backends=sems)
