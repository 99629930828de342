"""Ill-formed programs fail loudly, never hang (simulated): desync, timeouts, cancellation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcrdl
from mcrdl.testing import SimDeadlock, SimWorld, check_program, programs

from . import examples
from .broken import PerRankSelector

SEMS = {"mpi": "mpi", "gloo": "mpi"}


def test_different_collectives_raise_desync_on_every_member():
    world = SimWorld(3, SEMS, seed=0, debug=True)

    def program(comm):
        comm.allreduce(np.ones(4), backend="mpi").wait()
        try:
            if comm.rank == 1:
                comm.broadcast(np.ones(4), root=0, backend="mpi").wait()
            else:
                comm.allreduce(np.ones(4), backend="mpi").wait()
        except mcrdl.DesyncError as exc:
            return str(exc)
        return None

    messages = world.run(program)
    assert all(m is not None for m in messages), messages
    for m in messages:
        assert "members of communicator world submitted different collectives" in m
        assert "rank 0: allreduce#2 float64[4] op=SUM on mpi" in m
        assert "rank 1: broadcast#2 float64[4] root=0 on mpi" in m


def test_per_rank_backend_choice_is_a_desync_not_a_hang_in_debug_mode():
    world = SimWorld(2, SEMS, seed=0, debug=True, selector_factory=PerRankSelector)

    def program(comm):
        with pytest.raises(mcrdl.DesyncError, match=r"rank 0: allreduce#1 float64\[3\] "
                                                     r"op=SUM on mpi; rank 1: allreduce#1 "
                                                     r"float64\[3\] op=SUM on gloo"):
            comm.allreduce(np.ones(3)).wait()
        return True

    assert world.run(program) == [True, True]


def test_the_same_choice_without_debug_mode_hangs_and_the_world_says_so():
    world = SimWorld(2, SEMS, seed=0, selector_factory=PerRankSelector)
    with pytest.raises(SimDeadlock, match=r"ranks \[1\] have not issued it"):
        world.run(lambda comm: comm.allreduce(np.ones(3)).wait())


DEBUG = settings(max_examples=examples(60), deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))


@DEBUG
@given(programs(backends=tuple(SEMS), max_size=4), st.integers(0, 999))
def test_debug_mode_never_flags_a_well_formed_program(program, seed):
    check_program(program, seed=seed, backends=SEMS, debug=True)


def test_timeout_names_the_operation_and_the_peers_that_did_not_arrive():
    world = SimWorld(3, SEMS, seed=0, timeout=0.5)

    def program(comm):
        if comm.rank == 2:
            return None  # never submits its part
        # The first rank to time out breaks the communicator: the other learns of it from
        # its notice (or times out itself first); either way the message names the cause.
        with pytest.raises((mcrdl.CommTimeoutError, mcrdl.CommBrokenError)) as info:
            comm.allreduce(np.ones(2), backend="mpi").wait()
        return str(info.value)

    messages = world.run(program)
    for m in messages[:2]:
        assert "allreduce#1 on lane mpi:world" in m
        assert "did not finish within 0.5 s of being issued; ranks [2] have not issued it" in m


def test_a_receive_that_times_out_names_its_peer_tag_and_the_send_not_posted():
    world = SimWorld(2, SEMS, seed=0, timeout=0.5)

    def program(comm):
        peer = 1 - comm.rank
        with pytest.raises((mcrdl.CommTimeoutError, mcrdl.CommBrokenError)) as info:
            comm.recv(np.empty(2), peer, tag=7 + comm.rank, backend="mpi").wait()
        return str(info.value)

    messages = world.run(program)
    assert any(
        m.startswith("recv#1 from rank 1, tag 7, on lane mpi:world (rank 0 of 2) did not "
                     "finish within 0.5 s of being issued; rank 1 has not posted its send")
        or m.startswith("recv#1 from rank 0, tag 8, on lane mpi:world (rank 1 of 2) did not "
                        "finish within 0.5 s of being issued; rank 0 has not posted its send")
        for m in messages), messages


def test_cancelling_a_pending_collective_breaks_its_communicator_on_every_member():
    """Rank 1 cancels a collective its peer issues: rank 0 must not match the next one in its
    place. Every unfinished and later operation on the communicator fails, on both ranks,
    naming the cancellation; the dependant fails with it; another communicator goes on."""
    world = SimWorld(2, SEMS, seed=0)

    def program(comm):
        other = comm.split(0)
        x = np.ones(4)
        first = comm.allreduce(x, backend="gloo")
        second = comm.allreduce(x, backend="mpi")  # waits for first (same buffer)
        third = comm.broadcast(x, backend="mpi", after=[second])
        if comm.rank == 1:
            assert second.cancel() is True and second.cancelled()
            with pytest.raises(mcrdl.DependencyFailedError, match=r"which cancelled"):
                third.wait()
        outcomes = []
        for fut in (first, second, third, comm.barrier()):
            try:
                fut.wait()
                outcomes.append("done")
            except mcrdl.MCRDLError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
        assert other.allreduce(np.ones(2)).wait().tolist() == [2.0, 2.0]
        return outcomes

    zero, one = world.run(program)
    cause = "communicator world is broken (on rank 1, allreduce#3 on lane mpi:world was " \
            "cancelled)"
    # rank 0: first may finish before the news arrives; second and the barrier cannot.
    assert zero[0] == "done" or cause in zero[0]
    for outcome in zero[1:]:
        assert outcome.startswith("CommBrokenError") and cause in outcome, outcome
    assert one[1].startswith("FutureCancelledError") and one[2].startswith("Dependency")
    assert one[3].startswith("CommBrokenError") and cause in one[3]


def test_an_issued_collective_cannot_be_cancelled_where_its_backend_cannot():
    world = SimWorld(2, SEMS, seed=0)

    def program(comm):
        fut = comm.allreduce(np.ones(4), backend="mpi")
        with pytest.raises(mcrdl.InvalidStateError, match=r"cannot cancel .* issued already"):
            fut.cancel()
        return fut.wait().tolist()

    assert world.run(program) == [[2.0] * 4] * 2


def test_operations_failed_by_a_break_keep_nothing_alive():
    """Operations queued behind the one that broke the communicator fail and leave its lane,
    and an emulated AVG's finishing step (which holds its tensor) goes with them: a program
    that drops its references gets its memory back (before, the failed futures stayed in
    the lane's queue forever, the AVG's closure holding the tensor)."""
    import gc
    import weakref

    def program(comm):
        lane = comm._slots["mpi"].lane
        a, x, y = np.ones(4), np.ones(4), np.ones(4)
        fa = comm.allreduce(a, backend="mpi")
        fb = comm.allreduce(x, mcrdl.ReduceOp.AVG, backend="mpi")  # queued behind fa
        fc = comm.allreduce(y, backend="mpi")
        fb.cancel()
        for f in (fa, fb, fc):
            try:
                f.wait()
            except Exception:  # noqa: BLE001 - failing is what is tested here
                pass
        refs = [weakref.ref(x), weakref.ref(y)]
        kept = fb  # a failed future the program keeps does not keep its tensor either
        del a, x, y, fa, fb, fc, f
        gc.collect()
        assert kept.exception() is not None
        return [r() is None for r in refs], len(lane.pending)

    assert SimWorld(2, {"mpi": "windowed"}, seed=1).run(program) == [([True, True], 0)] * 2
