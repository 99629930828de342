"""Fused named allreduces in the engine (`mcrdl.engine._fusion`): the carrier takes its
members in flight with it, and they end with it, done or failed, in step with their peers."""

from __future__ import annotations

import numpy as np
import pytest

from mcrdl import BackendError, CommBrokenError, DependencyFailedError, InvalidStateError
from mcrdl._buffers import as_buffer
from mcrdl._types import ReduceOp
from mcrdl.engine import CommFuture
from mcrdl.engine import _fusion
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


def _agreed(engine, backend, arrays, op=ReduceOp.SUM):
    """Submit a named allreduce of each array, then fuse and place them as one round."""
    group = backend.world()
    lane = engine.lane(backend, group, engine.comm("world", group.rank, group.size))
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
        _fusion.fuse(futs)
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
    assert not engine.spin_lone(futs[1])  # (no request of its own to spin on)
    with pytest.raises(InvalidStateError, match=r"fused into allreduce#1"):
        futs[2].cancel()
    fused *= 2  # what the peers' sum would be
    mpi.finish(req)
    engine.poll_once()
    assert [f.state for f in futs] == ["DONE"] * 3
    assert [a.tolist() for a in arrays] == [[2.0, 2.0], [4.0, 4.0, 4.0], [6.0]]
    assert [f.result() is a for f, a in zip(futs, arrays)] == [True] * 3


def test_a_carrier_failing_in_flight_fails_its_members_and_leaves_the_communicator(engine,
                                                                                   mpi):
    """As an operation that ran alone: the members ran on every member as here, so they fail
    with their carrier, in step, and the communicator goes on."""
    arrays = [np.full(2, 1.0), np.full(2, 2.0)]
    futs = _agreed(engine, mpi, arrays)
    mpi.finish(mpi.started[0], BackendError("lost a message"))
    engine.poll_once()
    assert futs[0].state == "FAILED" and isinstance(futs[0].exception(), BackendError)
    assert futs[1].state == "FAILED"
    with pytest.raises(DependencyFailedError, match=r"fused into allreduce#1, which failed: "
                                                    r"lost a message"):
        futs[1].result()
    assert [a.tolist() for a in arrays] == [[1.0, 1.0], [2.0, 2.0]]  # nothing copied back
    assert futs[0].lane.comm.broken is None
    later = _agreed(engine, mpi, [np.ones(1)])
    assert later[0].state == "ISSUED"


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
    """Spares are made at the ``FUSION_BYTES`` of their time: a later, larger limit must not
    copy a group into one of them (it would write past its end)."""
    monkeypatch.setattr(_fusion, "_SPARES", {})
    monkeypatch.setattr(_fusion, "FUSION_BYTES", 32)
    futs = _agreed(engine, mpi, [np.ones(2), np.ones(2)])
    mpi.finish(mpi.started[0])
    engine.poll_once()
    assert [f.state for f in futs] == ["DONE"] * 2
    monkeypatch.setattr(_fusion, "FUSION_BYTES", 1 << 20)
    _agreed(engine, mpi, [np.full(40, 1.0), np.full(40, 2.0)])
    fused = mpi.started[1].args[1].obj
    assert len(fused) == 80 and fused.tolist() == [1.0] * 40 + [2.0] * 40
