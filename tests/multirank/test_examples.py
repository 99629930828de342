"""The workload examples train correctly: after a few steps every rank's parameters equal
those of one process training the same model on the whole global batch, on each backend,
on auto, and on a mix of two (launched at 2 and 4 ranks by tests/test_multirank.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mcrdl
import mcrdl.torch
from examples import data_parallel, dlrm, moe

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def comm():
    mcrdl.torch.init_process_group()  # mcrdl, and torch.distributed over it for DDP
    yield mcrdl.torch.communicator()
    dist.destroy_process_group()
    mcrdl.finalize()


def _assert_same_parameters(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _ran_on(run, kind: str = "allreduce") -> set[str]:
    return {key.rpartition(" on ")[2] for key in run.ops if key.startswith(kind + " ")}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", ["mpi", "gloo", "auto", "mix"])
def test_data_parallel_with_mcrdl_buckets(comm, backend, overlap):
    model, run = data_parallel.train(comm, "mcrdl", backend, STEPS, overlap)
    _assert_same_parameters(model, data_parallel.reference(STEPS, comm.size))
    if backend in ("mpi", "gloo"):
        assert _ran_on(run) == {backend}
    elif backend == "mix":
        assert _ran_on(run) == {"mpi", "gloo"}


@pytest.mark.parametrize("backend", ["mpi", "gloo", "auto"])
def test_data_parallel_with_ddp(comm, backend):
    model, run = data_parallel.train(comm, "ddp", backend, STEPS)
    _assert_same_parameters(model, data_parallel.reference(STEPS, comm.size))
    if backend != "auto":
        assert _ran_on(run) == {backend}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", ["mpi", "gloo", "auto", "mix"])
def test_moe(comm, backend, overlap):
    mine, run = moe.train(comm, backend, STEPS, overlap)
    ref = moe.reference(STEPS, comm.size)
    experts = slice(comm.rank * moe.EXPERTS_PER_RANK, (comm.rank + 1) * moe.EXPERTS_PER_RANK)
    for name, want in (("gate", ref["gate"]), ("w1", ref["w1"][experts]),
                       ("w2", ref["w2"][experts])):
        torch.testing.assert_close(mine[name], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    if backend in ("mpi", "gloo"):
        assert _ran_on(run, "alltoallv") == _ran_on(run) == {backend}
    elif backend == "mix":
        assert (_ran_on(run, "alltoallv"), _ran_on(run)) == ({"gloo"}, {"mpi"})


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", ["mpi", "gloo", "auto", "mix"])
def test_dlrm(comm, backend, overlap):
    model, run = dlrm.train(comm, backend, STEPS, overlap)
    ref = dlrm.reference(STEPS, comm.size)
    _assert_same_parameters(model.mlps, ref.mlps)
    for t in range(comm.rank * dlrm.TABLES_PER_RANK, (comm.rank + 1) * dlrm.TABLES_PER_RANK):
        _assert_same_parameters(model.tables[t], ref.tables[t])
    if backend in ("mpi", "gloo"):
        assert _ran_on(run, "alltoall") == _ran_on(run) == {backend}
    elif backend == "mix":
        assert (_ran_on(run, "alltoall"), _ran_on(run)) == ({"gloo"}, {"mpi"})
