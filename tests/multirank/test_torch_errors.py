"""The torch backend's error paths that need a runtime of their own (launched at 2 ranks with
MCRDL_DEBUG=1 and MASTER_ADDR/MASTER_PORT set): torch first under mpiexec, with a timeout
given to dist.init_process_group; a desync and a timeout surfacing through Work.wait()."""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import mcrdl
import mcrdl.torch

TIMEOUT = 4.0


@pytest.fixture(scope="module", autouse=True)
def pg():
    """torch first: dist.init_process_group("mcrdl") from env:// under mpiexec (the rank and
    size from the MPI launcher), so mcrdl comes up from _create with MPI and gloo."""
    os.environ.setdefault("RANK", os.environ["PMI_RANK"])
    os.environ.setdefault("WORLD_SIZE", os.environ["PMI_SIZE"])
    dist.init_process_group("mcrdl", timeout=datetime.timedelta(seconds=TIMEOUT))
    yield
    dist.destroy_process_group()
    mcrdl.finalize()


def _expect_failure(work, kind):
    """``work.wait()`` raises ``kind``; the Work and its future say so afterwards."""
    fut = work.get_future()
    with pytest.raises(kind) as info:
        work.wait()
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), kind)
    with pytest.raises(Exception,
                       match=f"{type(info.value).__name__}|{re.escape(str(info.value)[:40])}"):
        fut.wait()
    return info.value


def test_torch_first_under_mpiexec_brings_up_mpi_with_torchs_timeout():
    comm = mcrdl.torch.communicator()
    assert set(comm.backends) >= {"mpi", "gloo"}, comm.backends
    assert comm.runtime.config.timeout == TIMEOUT
    assert comm.runtime.config.debug
    for name in ("mpi", "gloo"):
        with mcrdl.torch.backend(name):
            t = torch.ones(3)
            dist.all_reduce(t)
            assert t.tolist() == [float(dist.get_world_size())] * 3


def test_a_group_asking_for_another_timeout_is_warned():
    with pytest.warns(UserWarning, match=r"asks for a 9 s timeout, but mcrdl times out every "
                                         r"operation after its runtime's 4.0 s"):
        group = dist.new_group(timeout=datetime.timedelta(seconds=9))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == dist.get_world_size()


def test_a_desync_fails_the_work_on_every_rank():
    """Rank 0 all-reduces where the others broadcast (debug mode compares fingerprints)."""
    group = dist.new_group()
    t = torch.ones(4)
    with mcrdl.torch.backend("mpi"):
        if dist.get_rank() == 0:
            work = dist.all_reduce(t, group=group, async_op=True)
        else:
            work = dist.broadcast(t, group_src=0, group=group, async_op=True)
    error = _expect_failure(work, mcrdl.DesyncError)
    assert "allreduce" in str(error) and "broadcast" in str(error)
    dist.barrier()  # the default group is unaffected


def test_a_timeout_fails_the_work():
    """Rank 0 all-reduces on a group whose other members never do: its Work.wait() raises
    CommTimeoutError after the timeout torch gave. The others wait for it through torch's
    store (a collective of theirs would time out meanwhile)."""
    group = dist.new_group()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() != 0:
        store.wait(["timed out"], datetime.timedelta(seconds=TIMEOUT + 30))
    else:
        t0 = time.monotonic()
        with mcrdl.torch.backend("mpi"):
            work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
        error = _expect_failure(work, mcrdl.CommTimeoutError)
        assert TIMEOUT <= time.monotonic() - t0 < TIMEOUT + 10
        assert f"did not finish within {TIMEOUT:g} s of being issued" in str(error)
        store.set("timed out", "1")
    dist.barrier()
