"""The contract suite: every operation x dtype x ReduceOp x size, on every backend, vs numpy.

Runs inside every rank (tests/test_multirank.py launches it at 2 and 4 ranks). A backend that
declares it cannot run a case must refuse it with UnsupportedOperationError; every case it
declares it can run must match the numpy reference on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcrdl import DType, ReduceOp, UnsupportedOperationError

from .reference import DTYPES, alltoallv_counts, as_buffer, make, reduce, to_numpy

BACKENDS = ["mpi", "gloo"]
REDUCING = ["allreduce", "reduce", "reduce_scatter"]
MOVING = ["broadcast", "gather", "allgather", "scatter", "alltoall", "alltoallv"]
OPS = list(ReduceOp)


def shapes(size: int) -> list[tuple[int, ...]]:
    """From 0 elements to a few hundred, with a dim 0 that splits into ``size`` chunks."""
    return [(0, 3), (size,), (size * 2, 5, 3), (size * 41, 7)]


def inputs(case, comm, dtype, shape, op=None):
    return [make(case, r, dtype, shape, op) for r in range(comm.size)]


def run_case(comm, backend, opname, dtype, shape, kind, op=None, root=0):
    """Submit one case and return (result, reference), both numpy (None where no result)."""
    case = f"{opname}/{dtype}/{shape}/{kind}/{op}/{root}"
    xs = inputs(case, comm, dtype, shape, op)
    me = comm.rank
    buf = as_buffer(xs[me], dtype, kind)
    n = comm.size
    if opname == "allreduce":
        res = comm.allreduce(buf, op, backend=backend).wait()
        assert res is buf
        ref = reduce(np.stack(xs), op, dtype)
    elif opname == "reduce":
        res = comm.reduce(buf, root, op, backend=backend).wait()
        assert res is buf
        ref = reduce(np.stack(xs), op, dtype) if me == root else xs[me]
    elif opname == "reduce_scatter":
        res = comm.reduce_scatter(buf, op, backend=backend).wait()
        ref = np.split(reduce(np.stack(xs), op, dtype), n)[me]
    elif opname == "broadcast":
        res = comm.broadcast(buf, root, backend=backend).wait()
        assert res is buf
        ref = xs[root]
    elif opname == "gather":
        res = comm.gather(buf, root, backend=backend).wait()
        ref = np.concatenate(xs) if me == root else None
    elif opname == "allgather":
        res = comm.allgather(buf, backend=backend).wait()
        ref = np.concatenate(xs)
    elif opname == "scatter":
        res = comm.scatter(buf, root, backend=backend).wait()
        ref = np.split(xs[root], n)[me]
    elif opname == "alltoall":
        res = comm.alltoall(buf, backend=backend).wait()
        ref = np.concatenate([np.split(x, n)[me] for x in xs])
    elif opname == "alltoallv":
        rows = shape[0]
        table = alltoallv_counts(n, rows)
        send = table[me]
        recv = [table[i][me] for i in range(n)]
        exchange = (sum(shape) % 2) == 0  # half the cases let mcrdl exchange the counts
        res = comm.alltoallv(buf, send, None if exchange else recv, backend=backend).wait()
        pieces = []
        for i in range(n):
            offs = np.cumsum([0] + table[i])
            pieces.append(xs[i][offs[me]:offs[me] + table[i][me]])
        ref = np.concatenate(pieces)
    else:  # pragma: no cover
        raise AssertionError(opname)
    return (None if res is None else to_numpy(res)), ref


def check(failures, label, got, ref):
    if ref is None:
        if got is not None:
            failures.append(f"{label}: expected None, got {got!r}")
        return
    if got is None or got.shape != ref.shape or not np.array_equal(got, ref):
        failures.append(f"{label}: got {got!r}\n  expected {ref!r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opname", REDUCING)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reducing(comm, backend, opname, dtype):
    caps = comm.runtime.backend(backend).capabilities
    failures = []
    for op in OPS:
        floating = dtype.startswith(("float", "bfloat", "complex"))
        if (op is ReduceOp.AVG and not floating) or (op.is_bitwise and floating):
            with pytest.raises(ValueError, match="would truncate|is bitwise"):
                getattr(comm, opname)(as_buffer(make("x", 0, dtype, (comm.size,)), dtype, "torch"),
                                      op=op, backend=backend)
            continue
        if not caps.can_reduce(op, DType(dtype)):
            with pytest.raises(UnsupportedOperationError, match=f"^{backend} cannot reduce {dtype}"):
                getattr(comm, opname)(as_buffer(make("x", 0, dtype, (comm.size,)), dtype, "torch"),
                                      op=op, backend=backend)
            continue
        for shape in shapes(comm.size):
            kinds = ["torch"] + (["numpy"] if dtype != "bfloat16" and shape[0] == comm.size else [])
            for kind in kinds:
                roots = [0, comm.size - 1] if opname == "reduce" else [0]
                for root in roots:
                    got, ref = run_case(comm, backend, opname, dtype, shape, kind, op, root)
                    check(failures, f"{opname} {dtype} {op.name} {shape} {kind} root={root}",
                          got, ref)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opname", MOVING)
@pytest.mark.parametrize("backend", BACKENDS)
def test_moving(comm, backend, opname, dtype):
    failures = []
    for shape in shapes(comm.size):
        kinds = ["torch"] + (["numpy"] if dtype != "bfloat16" and shape[0] == comm.size else [])
        for kind in kinds:
            roots = [0, comm.size - 1] if opname in ("broadcast", "gather", "scatter") else [0]
            for root in roots:
                got, ref = run_case(comm, backend, opname, dtype, shape, kind, None, root)
                check(failures, f"{opname} {dtype} {shape} {kind} root={root}", got, ref)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_mebibyte(comm, backend, dtype):
    """The large end: ~1 MiB per rank for every operation."""
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    rows = (1 << 20) // itemsize // comm.size * comm.size
    failures = []
    can = comm.runtime.backend(backend).capabilities.can_reduce(ReduceOp.SUM, DType(dtype))
    for opname in REDUCING if can else []:
        got, ref = run_case(comm, backend, opname, dtype, (rows,), "torch", ReduceOp.SUM)
        check(failures, f"{opname} {dtype} 1MiB", got, ref)
    for opname in MOVING:
        got, ref = run_case(comm, backend, opname, dtype, (rows,), "torch")
        check(failures, f"{opname} {dtype} 1MiB", got, ref)
    assert not failures, "\n".join(f[:300] for f in failures[:5])


@pytest.mark.parametrize("backend", BACKENDS + [None])
def test_barrier_and_auto(comm, backend):
    assert comm.barrier(backend=backend).wait() is None
    x = torch.full((comm.size,), float(comm.rank + 1))
    assert comm.allreduce(x, backend=backend).wait().tolist() == [
        float(sum(range(1, comm.size + 1)))] * comm.size
