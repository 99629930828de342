"""Fused named allreduces in the engine (`mcrdl.engine._fusion`): the carrier takes its
members in flight with it, and they end with it, done or failed as it did, in step with their
peers; the engine's views and timeouts count them as in flight."""

from __future__ import annotations

import numpy as np
import pytest

from mcrdl import (
    BackendError,
    CommBrokenError,
    CommTimeoutError,
    InvalidStateError,
    RuntimeFinalizedError,
)
from mcrdl.core._buffers import as_buffer
from mcrdl.core._types import ReduceOp
from mcrdl.engine import CommFuture, Engine, _fusion
from mcrdl.observe._flight import flight_record
from tests.manual_backend import ManualBackend


class Agreement:
    """Stands for a communicator's `Names`: collects what becomes ready; the test places it
    as an agreement round would (`Names._agreed`: fuse, then place)."""

    def __init__(self):
        self.ready_futs = []

    def hold(self, fut, sig):
        pass

    def ready(self, fut):
        self.ready_futs.append(fut)

    def drop(self, fut):
        pass


@pytest.fixture
def mpi():
    return ManualBackend(name="mpi", size=2)  # (can cancel: a member must still refuse)


def _agreed(engine, backend, arrays, op=ReduceOp.SUM, comm="world", limit=1 << 20):
    """Submit a named allreduce of each array, then fuse and place them as one round."""
    group = backend.world()
    lane = engine.lane(backend, group, engine.comm(comm, group.rank, group.size))
    names = Agreement()
    futs = []
    for i, array in enumerate(arrays):
        buf = as_buffer(array, "buf", True)
        fut = CommFuture("allreduce", lane, i + 1, backend.start_allreduce, (group, buf, op),
                         (), buf.ranges, array, buf.nbytes)
        fut.name = f"a{i}"
        futs.append(engine.submit(fut, named=(names, "sig")))
    assert names.ready_futs == futs
    with engine._lock:
        _fusion.fuse(futs, limit)
        engine.place(futs)
        engine._run_work()
    return futs


def test_a_fused_group_runs_as_one_allreduce_and_each_member_gets_its_share(engine, mpi):
    arrays = [np.full(2, 1.0), np.full(3, 2.0), np.full(1, 3.0)]
    futs = _agreed(engine, mpi, arrays)
    (req,) = mpi.started  # one allreduce, of the members' bytes side by side
    fused = req.args[1].obj
    assert fused.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0, 3.0]
    assert [f.state for f in futs] == ["ISSUED"] * 3  # the members are in flight with it
    assert engine.stats().in_flight == 3 and engine.unfinished() == futs
    assert all(f"allreduce#{i}" in flight_record(engine) for i in (1, 2, 3))
    with pytest.raises(InvalidStateError, match=r"fused into allreduce#1"):
        futs[2].cancel()
    assert not engine.poll(futs[1])  # in focus: its carrier's request, not finished
    fused *= 2  # what the peers' sum would be
    mpi.finish(req)
    assert engine.poll(futs[2])  # found by a direct test of its carrier's request
    assert [f.state for f in futs] == ["DONE"] * 3
    assert [a.tolist() for a in arrays] == [[2.0, 2.0], [4.0, 4.0, 4.0], [6.0]]
    assert [f.result() is a for f, a in zip(futs, arrays)] == [True] * 3


def test_a_carrier_failing_in_flight_fails_its_members_and_leaves_the_communicator(engine,
                                                                                   mpi):
    """As an operation that ran alone: the members ran on every member as here, so they fail
    with their carrier, with its kind of error, in step, and the communicator goes on."""
    arrays = [np.full(2, 1.0), np.full(2, 2.0)]
    futs = _agreed(engine, mpi, arrays)
    mpi.finish(mpi.started[0], BackendError("lost a message"))
    engine.poll()
    assert futs[0].state == "FAILED" and isinstance(futs[0].exception(), BackendError)
    assert futs[1].state == "FAILED"
    with pytest.raises(BackendError, match=r"fused into allreduce#1, which failed: "
                                           r"lost a message"):
        futs[1].result()
    assert [a.tolist() for a in arrays] == [[1.0, 1.0], [2.0, 2.0]]  # nothing copied back
    assert futs[0].lane.comm.broken is None
    later = _agreed(engine, mpi, [np.ones(1)])
    assert later[0].state == "ISSUED"


@pytest.mark.parametrize("error", [None, BackendError("lost a message")])
def test_a_fused_group_keeps_no_members_buffer_once_it_ended(engine, mpi, error):
    """Done or failed, once the caller and the backend let go, nothing of the fusion's keeps
    a member's buffer (its entry for a simulated world's faults included): the spare buffer
    and its views outlive the group, the members' objects must not."""
    import gc
    import weakref

    arrays = [np.full(2, 1.0), np.full(2, 2.0)]
    futs = _agreed(engine, mpi, arrays)
    view = mpi.started[0].args[1].obj
    assert _fusion.carried(view) == arrays  # in flight: the simulated world sees them
    mpi.finish(mpi.started[0], error)
    engine.poll()
    assert [f.state for f in futs] == ["FAILED" if error else "DONE"] * 2
    refs = [weakref.ref(a) for a in arrays]
    del arrays, futs, view
    mpi.started.clear()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_members_time_out_and_are_given_up_with_their_carrier(clock, mpi):
    """A timeout names every operation of the group (the flight recorder's and the hook's
    lists), each failing with CommTimeoutError; finalize's fail_all gives each its error."""
    seen = []
    engine = Engine(background=False, clock=clock, timeout=5.0,
                    on_timeout=lambda expired: seen.append((expired, flight_record(engine))))
    futs = _agreed(engine, mpi, [np.ones(1), np.ones(2), np.ones(3)])
    clock.now += 10.0
    engine.check_deadlines(clock.now)
    ((expired, record),) = seen
    assert expired == futs and all(f"allreduce#{i}" in record for i in (1, 2, 3))
    for fut in futs:
        assert fut.state == "FAILED" and isinstance(fut.exception(), CommTimeoutError)
    group = _agreed(engine, mpi, [np.ones(1), np.ones(1)], comm="other")  # (world broke)
    assert engine.fail_all(lambda f: RuntimeFinalizedError("finalized")) == 2
    assert all(isinstance(f.exception(), RuntimeFinalizedError) for f in group)


def test_a_carrier_failing_to_start_breaks_the_communicator_and_its_members_never_run(
        engine, mpi):
    arrays = [np.full(2, 1.0), np.full(2, 2.0), np.full(2, 3.0)]
    mpi.fail_start = "no memory"
    futs = _agreed(engine, mpi, arrays)
    assert not mpi.started
    assert futs[0].state == "FAILED" and futs[0].lane.comm.broken is not None
    for fut in futs[1:]:
        assert fut.state == "FAILED" and isinstance(fut.exception(), CommBrokenError)
    assert [a.tolist() for a in arrays] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_a_spare_fusion_buffer_too_small_for_a_later_group_is_not_reused(engine, mpi,
                                                                         monkeypatch):
    """Spares are made at the ``fusion_bytes`` of their runtime: a larger limit must not copy
    a group into one of them (it would write past its end)."""
    monkeypatch.setattr(_fusion, "_SPARES", {})
    futs = _agreed(engine, mpi, [np.ones(2), np.ones(2)], limit=32)
    mpi.finish(mpi.started[0])
    engine.poll()
    assert [f.state for f in futs] == ["DONE"] * 2
    _agreed(engine, mpi, [np.full(40, 1.0), np.full(40, 2.0)])
    fused = mpi.started[1].args[1].obj
    assert len(fused) == 80 and fused.tolist() == [1.0] * 40 + [2.0] * 40
