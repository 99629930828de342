"""A user's own step checked as it is (``mcrdl.testing.check_step``): the pipeline step of
``examples/pipeline_step.py`` (asyncio micro-batch tasks, sends and receives between stages,
a named alltoallv on gloo, allreduces on MPI and on the world) passes at 2 and 4 ranks under
MPI-like and NCCL-like semantics, and each of its three bugs is found, named by size,
semantics and seed, with what the ranks wait for."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import mcrdl
from mcrdl.testing import (
    SEMANTICS,
    Recording,
    SimDeadlock,
    SimMismatch,
    SimWorld,
    StepFailed,
    check_step,
    record,
    replay_ranks,
)

_PATH = Path(__file__).resolve().parents[2] / "examples" / "pipeline_step.py"
_spec = importlib.util.spec_from_file_location("pipeline_step", _PATH)
example = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["pipeline_step"] = example
_spec.loader.exec_module(example)  # type: ignore[union-attr]

SEEDS = range(6)


@pytest.mark.timeout(240)
def test_the_pipeline_step_passes_at_2_and_4_ranks_under_mpi_and_nccl_semantics():
    check_step(example.step, sizes=(2, 4), seeds=SEEDS, semantics=("mpi", "nccl"),
               check=example.check_results)


def _failure(bug: str) -> StepFailed:
    with pytest.raises(StepFailed) as info:
        check_step(lambda comm: example.step(comm, bug), sizes=(2, 4), seeds=SEEDS,
                   semantics=("mpi", "nccl"), check=example.check_results)
    return info.value


@pytest.mark.timeout(240)
def test_receiving_before_sending_on_both_stages_is_a_deadlock_naming_the_messages():
    failed = _failure("recv-first")
    assert (failed.size, failed.semantics, failed.seed) == (2, "mpi", 0)
    assert isinstance(failed.error, SimDeadlock)
    report = str(failed.error)
    # Each message says which ranks, which tag, and which side is missing.
    assert ("message #0 from rank 0 to rank 1, tag 0: rank 0 has not posted its send"
            in report), report
    assert ("message #0 from rank 1 to rank 0, tag 100: rank 1 has not posted its send"
            in report), report
    assert str(failed).startswith("the step failed on 2 simulated ranks, 'mpi' semantics, "
                                  "seed 0: SimDeadlock: ")


@pytest.mark.timeout(240)
def test_a_stage_that_skips_a_world_collective_is_a_deadlock_naming_it():
    failed = _failure("skip")
    assert (failed.size, failed.semantics, failed.seed) == (2, "mpi", 0)
    assert isinstance(failed.error, SimDeadlock)
    assert "allreduce #" in str(failed.error) and "ranks [1] have not issued it" in str(
        failed.error)


@pytest.mark.timeout(240)
def test_micro_batch_collectives_without_names_are_found_swapped():
    """Unnamed, the micro-batches' collectives reach the communicators in the order their
    receives complete, which differs between ranks: a mismatch of shapes, never a hang."""
    failed = _failure("unnamed")
    assert isinstance(failed.error, SimMismatch), failed


def test_a_seed_replays_the_failure_exactly():
    """``StepFailed`` names what replays it: the same world gives the same report."""
    failed = _failure("skip")
    reports = []
    for _ in range(2):
        world = SimWorld(failed.size, SEMANTICS[failed.semantics], seed=failed.seed)
        with pytest.raises(SimDeadlock) as info:
            world.run(lambda comm: __import__("asyncio").run(example.step(comm, "skip")))
        reports.append(str(info.value))
    assert reports[0] == reports[1] == str(failed.error)


def _misfit(backend):
    def step(comm):
        send = [2, 2] if comm.rank == 0 else [1, 1]
        recv = [2, 2]  # rank 1 sends 1 row to rank 0, which expects 2
        out = np.empty(sum(recv))
        comm.alltoallv(np.ones(sum(send)), send, out=out, recv_counts=recv,
                       backend=backend).wait()

    return step


def test_alltoallv_counts_that_do_not_fit_are_a_mismatch_not_a_raw_error():
    """Members that disagree on an alltoallv's counts: the simulated world reports a
    SimMismatch naming the ranks and counts (a real MPI would fail or hang there)."""
    with pytest.raises(SimMismatch, match=(
            r"^mpi:world alltoallv #0: rank 1 sends 1 rows to rank 0, which expects 2 from "
            r"it \(recv_counts\); members must agree on every count$")):
        SimWorld(2, SEMANTICS["mpi"]).run(_misfit("mpi"))


def test_on_gloo_they_are_checked_first_as_on_the_real_gloo():
    """The simulated gloo checks an alltoallv's given counts across the members, as the
    real one does (where a misfit would end the process): DesyncError on every member."""
    def step(comm):
        with pytest.raises(mcrdl.DesyncError, match=r"rank 1 sends 1 rows to rank 0, which "
                                                     r"expects 2 from it"):
            _misfit("gloo")(comm)
        return True

    assert SimWorld(2, SEMANTICS["mpi"]).run(step) == [True, True]


def test_an_unknown_semantics_is_refused():
    with pytest.raises(ValueError, match=r"^semantics \['mpl'\] unknown; choose among "
                                         r"\['blocking', 'mpi', 'nccl'\]$"):
        check_step(lambda comm: None, semantics=("mpl",))


@pytest.mark.timeout(240)
def test_the_pipeline_step_passes_in_debug_mode():
    """The ranks share one process, so asyncio numbers their tasks apart ("Task-8" on one
    rank, "Task-11" on the next): debug mode must not compare those numbers (it raised
    DesyncError on every asyncio step here)."""
    check_step(example.step, sizes=(2, 4), seeds=range(3), semantics=("mpi",),
               check=example.check_results, debug=True)


@pytest.mark.timeout(240)
def test_unnamed_micro_batch_collectives_in_debug_mode_are_a_desync_suggesting_name():
    """Debug mode turns a swap into a DesyncError that suggests name= (or, where the
    swapped collectives' checks wait on each other, a deadlock); a seed in which the
    micro-batches happen to arrive in one order everywhere passes, with right results."""
    verdicts = []
    for size in (2, 4):
        for seed in SEEDS:
            try:
                check_step(lambda comm: example.step(comm, "unnamed"), sizes=(size,),
                           seeds=[seed], semantics=("mpi",), check=example.check_results,
                           debug=True)
            except StepFailed as failed:
                verdicts.append(failed.error)
    assert all(isinstance(e, (mcrdl.DesyncError, SimDeadlock)) for e in verdicts), verdicts
    assert any("from an unnamed task" in str(e) and "pass name= to each" in str(e)
               for e in verdicts), verdicts


def _recorded(size: int, bug: str | None, tmp_path) -> list:
    """Each rank's recording of one simulated run of the step (saved on leaving the block,
    also when the run failed)."""
    def program(comm):
        with record(comm, str(tmp_path / "step-{rank}.json")):
            return __import__("asyncio").run(example.step(comm, bug))

    world = SimWorld(size, SEMANTICS["mpi"], seed=3)
    if bug is None:
        world.run(program)
    else:
        with pytest.raises(SimDeadlock):
            world.run(program)
    return [Recording.load(str(tmp_path / f"step-{r}.json")) for r in range(size)]


@pytest.mark.parametrize("size", [2, 4])
def test_recordings_of_every_rank_replay_on_their_ranks(size, tmp_path):
    """Sends and receives, names, a sub-communicator's alltoallv and the tasks' waits all
    replay; a correct step's recordings pass under both semantics."""
    recs = _recorded(size, None, tmp_path)
    kinds = {op.kind for rec in recs for op in rec.ops}
    assert {"send", "recv", "alltoallv", "allreduce"} <= kinds, kinds
    assert any(op.name == "loss/0" for op in recs[0].ops)
    assert any(what == "wait" and task > 0 for what, _, task in recs[0].events)
    replay_ranks(recs, seeds=range(8))


def test_a_step_that_hung_is_recorded_up_to_the_hang_and_replays_into_it(tmp_path):
    """Stage 0 waits for a gradient before it sends: the run deadlocks, its recordings are
    saved all the same, and their replay finds the deadlock, naming the messages. (A replay
    that did not wait where the step waited would submit the sends and pass.)"""
    recs = _recorded(2, "recv-first", tmp_path)
    with pytest.raises(StepFailed) as info:
        replay_ranks(recs, seeds=range(4))
    assert isinstance(info.value.error, SimDeadlock)
    assert ("message #0 from rank 1 to rank 0, tag 100: rank 1 has not posted its send"
            in str(info.value.error)), info.value.error


def test_replay_ranks_refuses_an_incomplete_set_and_names_a_missing_backend(tmp_path):
    recs = _recorded(2, None, tmp_path)
    with pytest.raises(ValueError, match=r"one recording per rank of one world: got ranks "
                                         r"\[0\] of worlds of \[2\]"):
        replay_ranks(recs[:1])
    recs[0].ops[0].backend = "nccl"
    with pytest.raises(ValueError, match=r"ran on 'nccl', which the simulated world lacks: "
                                         r"pass rename=\{'nccl': 'mpi'\}"):
        replay_ranks(recs)
    replay_ranks(recs, seeds=range(2), rename={"nccl": "mpi"})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bug, verdict", [("recv-first", SimDeadlock), ("skip", SimDeadlock),
                                          ("unnamed", (SimMismatch, SimDeadlock,
                                                       mcrdl.DesyncError))])
def test_each_bug_is_found_at_2_and_4_ranks_under_both_semantics(bug, verdict):
    """Every bug, in every world the step is checked in: found within the seeds, with the
    world's verdict (unnamed collectives swap into a mismatch, into alltoallv counts that
    gloo's check refuses, or, on in-order NCCL-like lanes, into a wait that never ends)."""
    for size in (2, 4):
        for semantics in ("mpi", "nccl"):
            with pytest.raises(StepFailed) as info:
                check_step(lambda comm: example.step(comm, bug), sizes=(size,), seeds=SEEDS,
                           semantics=(semantics,), check=example.check_results)
            assert isinstance(info.value.error, verdict), (size, semantics, info.value)


def test_tasks_busy_with_asyncio_alone_are_not_taken_for_a_deadlock():
    """Rank 0's task c sends what rank 1 waits for, once task b (after five bare loop
    iterations, then a submission the MPI window holds back) sets an asyncio event. While
    b loops, rank 0's other task waits and nothing simulated moves: the world declared a
    deadlock there, though rank 0's loop had work ready."""
    async def step(comm):
        if comm.rank == 1:
            comm.recv(np.empty(1), 0, tag=3, backend="gloo").wait()
            comm.allreduce(np.ones(2), backend="mpi").wait()
            comm.allreduce(np.ones(3), backend="mpi").wait()
            return
        ready = asyncio.Event()

        async def a():
            await comm.allreduce(np.ones(2), backend="mpi")

        async def b():
            for _ in range(5):
                await asyncio.sleep(0)
            held = comm.allreduce(np.ones(3), backend="mpi")  # behind a's: nothing moves
            ready.set()
            await held

        async def c():
            await ready.wait()
            await comm.send(np.ones(1), 1, tag=3, backend="gloo")

        await asyncio.gather(a(), b(), c())

    check_step(step, sizes=(2,), seeds=range(20), semantics=("mpi",))
