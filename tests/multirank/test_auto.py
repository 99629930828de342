"""backend="auto" under a tuning table (launched with MCRDL_TUNING set to a synthetic table
that sends small messages to gloo, mid-sized ones to mpi and large ones to gloo again)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcrdl import ReduceOp

from .reference import alltoallv_counts


def test_the_table_is_loaded_and_agreed(comm):
    assert comm.runtime.tuning is not None
    assert comm.runtime.tuning.provenance["purpose"] == "test"


@pytest.mark.parametrize("elems,expected", [(8, "gloo"), (256, "mpi"), (4096, "gloo")])
def test_allreduce_follows_the_table(comm, elems, expected):
    x = torch.ones(elems)  # 32 B, 1 KiB, 16 KiB
    fut = comm.allreduce(x)
    assert fut.lane.backend_name == expected
    assert fut.wait()[0].item() == comm.size


@pytest.mark.parametrize("rows", [0, 1, 64, 1024])
def test_every_operation_through_auto(comm, rows):
    n, me = comm.size, comm.rank
    x = torch.arange(rows * n, dtype=torch.float32) + 100 * me
    assert torch.equal(comm.allreduce(x.clone(), ReduceOp.MAX).wait(),
                       torch.arange(rows * n, dtype=torch.float32) + 100 * (n - 1))
    b = x.clone()
    assert torch.equal(comm.broadcast(b, root=n - 1).wait(),
                       torch.arange(rows * n, dtype=torch.float32) + 100 * (n - 1))
    g = comm.allgather(x).wait()
    assert torch.equal(g, torch.cat([torch.arange(rows * n, dtype=torch.float32) + 100 * r
                                     for r in range(n)]))
    a = comm.alltoall(x).wait()
    chunks = [(torch.arange(rows * n, dtype=torch.float32) + 100 * r).chunk(n)[me]
              if rows else torch.empty(0) for r in range(n)]
    assert torch.equal(a, torch.cat(chunks))
    table = alltoallv_counts(n, rows * n)
    v = comm.alltoallv(x, table[me]).wait()  # exchanges counts; agrees on the total first
    offs = [np.cumsum([0] + table[r]) for r in range(n)]
    want = torch.cat([(torch.arange(rows * n, dtype=torch.float32) + 100 * r)
                      [offs[r][me]:offs[r][me] + table[r][me]] for r in range(n)])
    assert torch.equal(v, want)
    rs = comm.reduce_scatter(torch.ones(rows * n)).wait()
    assert torch.equal(rs, torch.full((rows,), float(n)))
    comm.barrier().wait()
