"""Record a real step (a world of one, real backends), replay it simulated on more ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mcrdl
from mcrdl.testing import Recording, record, replay


@pytest.fixture
def world():
    comm = mcrdl.init()
    yield comm
    mcrdl.finalize()


def moe_like_step(comm):
    tokens = torch.arange(8.0)
    grads = torch.ones(16)
    routed = comm.alltoall(tokens, backend="mpi")
    back = comm.alltoall(routed.wait() * 2, backend="mpi")
    comm.allreduce(grads, backend="gloo")
    comm.allreduce(grads, mcrdl.ReduceOp.MAX, backend="mpi")  # same buffer: after the gloo one
    comm.allgather(np.arange(4, dtype=np.int32), backend="gloo")
    return back.wait()


def test_record_and_replay_a_step(world, tmp_path):
    with record(world) as rec:
        moe_like_step(world)
    kinds = [op.kind for op in rec.ops]
    assert kinds == ["alltoall", "alltoall", "allreduce", "allreduce", "allgather"]
    assert rec.ops[3].after == () and rec.ops[2].buf == rec.ops[3].buf  # shared bytes
    path = tmp_path / "step.json"
    rec.save(str(path))
    again = Recording.load(str(path))
    assert again.ops == rec.ops
    assert replay(again, size=4, seeds=range(10)) == 10
    # under reassigned backends with NCCL-like and blocking semantics too
    assert replay(again, size=4, seeds=range(10, 20),
                  backends={"mpi": "mpi", "gloo": "nccl", "blk": "blocking"}) == 10


def test_point_to_point_is_refused_with_a_reason(world):
    with record(world) as rec:
        world.barrier().wait()
    rec.ops[0].kind = "send"
    with pytest.raises(ValueError, match=r"operation 0 is a send: point-to-point operations "
                                         r"cannot be replayed from one rank's recording"):
        replay(rec, seeds=[0])


def test_an_alltoallv_whose_counts_are_exchanged_is_recorded_whole(world):
    """The count exchange is an operation of its own, recorded with the edge the data
    exchange has to it, and the data exchange with its send counts: the step replays."""
    tokens = torch.arange(6.0).reshape(3, 2)
    with record(world) as rec:
        out = world.alltoallv(tokens, [3]).wait()
    assert out.tolist() == tokens.tolist()
    assert [op.kind for op in rec.ops] == ["alltoall", "alltoallv"]
    exchange, data = rec.ops
    assert data.after == (0,) and data.counts == (3,) and data.row == 2
    assert exchange.dtype == "int64" and exchange.exchange and not data.exchange
    assert replay(rec, seeds=range(5)) == 5


def test_an_alltoallv_on_a_sub_communicator_replays_at_the_world_size(tmp_path):
    """Recorded on a 2-member sub-communicator of a 4-rank world, its counts are 2 long: the
    replay compares them with that communicator's size, not the world's (it refused)."""
    from mcrdl.testing import SEMANTICS, SimWorld

    recs = {}

    def program(comm):
        pair = comm.split(comm.rank // 2)
        with record(comm) as rec:
            pair.alltoallv(np.arange(4.0), [1, 3], recv_counts=[1, 1] if pair.rank == 0
                           else [3, 3]).wait()
        recs[comm.rank] = rec

    SimWorld(4, SEMANTICS["mpi"], seed=0).run(program)
    assert recs[0].ops[0].comm_size == 2 and recs[0].ops[0].counts == (1, 3)
    assert replay(recs[0], size=4, seeds=range(3), reassign=False) == 3
