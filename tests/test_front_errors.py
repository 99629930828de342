"""Bad input raises a specific exception on the calling rank before anything is sent.

A communicator of size 4 (this rank: 1) over two manual backends named like the real ones; the
manual "mpi" declares the real mpi backend's inability to reduce bfloat16. After every refused
call, nothing has been started on any backend.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import mcrdl
from mcrdl import (
    BackendUnavailableError,
    CommClosedError,
    ReduceOp,
    RuntimeFinalizedError,
    UnknownBackendError,
    UnsupportedOperationError,
)
from mcrdl.backends import Capabilities
from mcrdl.core._config import Config
from mcrdl.core._types import DType, OpKind
from mcrdl.front._runtime import Runtime
from tests.manual_backend import ManualBackend

MPI_LIKE = Capabilities(
    ops=frozenset(OpKind),
    dtypes=frozenset(DType),
    reductions={op: frozenset(DType) - {DType.BFLOAT16}
                for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)},
)


@pytest.fixture
def backends():
    return {"mpi": ManualBackend(name="mpi", rank=1, size=4, capabilities=MPI_LIKE),
            "gloo": ManualBackend(name="gloo", rank=1, size=4)}


@pytest.fixture
def comm(backends):
    runtime = Runtime(Config(progress_thread=False), None, backends)
    yield runtime.world
    runtime.engine.fail_all(lambda f: RuntimeError("test over"))


@pytest.fixture(autouse=True)
def nothing_sent(backends):
    yield
    for b in backends.values():
        assert b.started == [] or b._allow_started, f"{b.name} started {b.started}"


def allow_started(backends):
    for b in backends.values():
        b._allow_started = True


ManualBackend._allow_started = False


def exact(msg: str) -> str:
    return "^" + re.escape(msg) + "$"


def test_non_contiguous_tensor(comm):
    t = torch.ones(4, 4).t()
    with pytest.raises(ValueError, match=exact(
            "buf is not contiguous (shape (4, 4), strides (1, 4)); pass buf.contiguous() "
            "— mcrdl never copies behind your back")):
        comm.allreduce(t)


def test_sparse_tensor_is_refused_naming_the_dense_form(comm):
    """A COO tensor (torch's gloo reduces those) was refused as "not contiguous", with
    advice (.contiguous()) that does not apply to it."""
    t = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    with pytest.raises(TypeError, match=exact(
            "buf is a sparse tensor (torch.sparse_coo); mcrdl moves dense tensors only: pass "
            "buf.to_dense() (a sparse allreduce as torch's gloo runs it is not supported)")):
        comm.allreduce(t)


def test_non_contiguous_array(comm):
    a = np.ones((4, 4))[:, ::2]
    with pytest.raises(ValueError, match=r"^buf is not C-contiguous \(shape \(4, 2\), strides "
                                         r"\(32, 16\)\); pass np.ascontiguousarray\(buf\)"):
        comm.broadcast(a)


def test_not_a_buffer(comm):
    with pytest.raises(TypeError, match=exact(
            "buf must be a torch.Tensor or numpy.ndarray, got builtins.list")):
        comm.allreduce([1.0, 2.0])


def test_dtype_nobody_carries(comm):
    with pytest.raises(TypeError, match=r"^buf has numpy dtype '>f4', which mcrdl does not "
                                        r"carry; supported: bool, uint8, .*\(native byte order\)$"):
        comm.allgather(np.ones(4, dtype=">f4"))
    with pytest.raises(TypeError, match=r"^buf has dtype torch.complex32, which mcrdl does not carry"):
        comm.allgather(torch.ones(4, dtype=torch.complex32))


def test_dtype_a_backend_cannot_reduce_names_those_that_can(comm):
    t = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedOperationError, match=exact(
            "mpi cannot reduce bfloat16 with SUM; backends that can: gloo")):
        comm.allreduce(t, backend="mpi")
    # auto respects capabilities: it goes to the backend that can
    allow_started(comm.runtime._backends)
    fut = comm.allreduce(t)
    assert fut.lane.backend_name == "gloo"


def test_rank_and_root_out_of_range(comm):
    t = torch.ones(4)
    with pytest.raises(ValueError, match=exact("dst=4 out of range for communicator of size 4")):
        comm.send(t, 4)
    with pytest.raises(ValueError, match=exact("src=-1 out of range for communicator of size 4")):
        comm.recv(t, -1)
    with pytest.raises(ValueError, match=exact("root=7 out of range for communicator of size 4")):
        comm.broadcast(t, root=7)
    with pytest.raises(TypeError, match=exact("root must be an int, got 1.0")):
        comm.reduce(t, root=1.0)
    with pytest.raises(ValueError, match=exact(
            "dst=1 is this rank; a message to oneself is a local copy: use tensor.copy_() instead")):
        comm.send(t, 1)


def test_tag_range(comm):
    with pytest.raises(ValueError, match=exact(
            "tag=40000 out of range; tags are 0..32767 on every backend")):
        comm.send(torch.ones(1), 0, tag=40000)


def test_dim0_not_divisible(comm):
    with pytest.raises(ValueError, match=exact(
            "alltoall needs dim 0 of buf divisible by the communicator size 4; got shape (6, 2)")):
        comm.alltoall(torch.ones(6, 2))
    with pytest.raises(ValueError, match=exact(
            "reduce_scatter needs dim 0 of buf divisible by the communicator size 4; got shape (3,)")):
        comm.reduce_scatter(torch.ones(3))
    with pytest.raises(ValueError, match=r"^scatter splits dim 0, but buf is 0-dimensional"):
        comm.scatter(torch.tensor(1.0))


def test_counts_that_do_not_sum(comm):
    with pytest.raises(ValueError, match=exact(
            "send_counts sum to 5 but buf has 6 rows along dim 0; they must be equal")):
        comm.alltoallv(torch.ones(6), [1, 1, 1, 2])
    with pytest.raises(ValueError, match=exact(
            "send_counts has 3 entries; the communicator has 4 ranks")):
        comm.alltoallv(torch.ones(6), [2, 2, 2])
    with pytest.raises(ValueError, match=exact("recv_counts has a negative count: [1, -1, 0, 0]")):
        comm.alltoallv(torch.ones(4), [1, 1, 1, 1], [1, -1, 0, 0])


def test_wrong_out(comm):
    t = torch.ones(4, 3)
    with pytest.raises(ValueError, match=exact(
            "out has shape (8, 3); allgather of buf with shape (4, 3) on 4 ranks needs (16, 3)")):
        comm.allgather(t, out=torch.empty(8, 3))
    # 1-d buffers: the rows and the number of dims must match too
    v = torch.ones(4)
    with pytest.raises(ValueError, match=exact(
            "out has shape (16, 1); allgather of buf with shape (4,) on 4 ranks needs (16,)")):
        comm.allgather(v, out=torch.empty(16, 1))
    with pytest.raises(ValueError, match=exact(
            "out has shape (8,); allgather of buf with shape (4,) on 4 ranks needs (16,)")):
        comm.allgather(v, out=torch.empty(8))
    with pytest.raises(ValueError, match=exact(
            "out has shape (1, 1); reduce_scatter of buf with shape (4,) on 4 ranks needs (1,)")):
        comm.reduce_scatter(v, out=torch.empty(1, 1))
    with pytest.raises(TypeError, match=exact(
            "out has dtype float64 but buf has float32; they must match")):
        comm.alltoall(t, out=torch.empty(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=exact(
            "out overlaps buf; alltoall cannot run in place: pass a separate out")):
        comm.alltoall(t, out=t)
    # alltoallv learns its out's rows from the peers, but checks the rest before anything runs
    with pytest.raises(TypeError, match=exact(
            "out has dtype float64 but buf has float32; they must match")):
        comm.alltoallv(t, [1, 1, 1, 1], out=torch.empty(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=exact(
            "out has shape (4, 2); alltoallv of buf with shape (4, 3) needs "
            "(sum(recv_counts), *(3,))")):
        comm.alltoallv(t, [1, 1, 1, 1], out=torch.empty(4, 2))
    for recv_counts in ([1, 1, 1, 1], None):
        with pytest.raises(ValueError, match=exact(
                "out overlaps buf; alltoallv cannot run in place: pass a separate out")):
            comm.alltoallv(t, [1, 1, 1, 1], recv_counts, out=t)
    assert comm.runtime.engine.stats().submitted == 0  # nothing was submitted


def test_read_only_receive_buffer(comm):
    a = np.ones(4)
    a.flags.writeable = False
    with pytest.raises(ValueError, match=exact(
            "buf is read-only but this operation writes it; pass a writable array")):
        comm.recv(a, 0)


def test_avg_on_integers_is_refused(comm):
    with pytest.raises(ValueError, match=exact(
            "AVG on int32 would truncate; use SUM and divide yourself, or a floating-point dtype")):
        comm.allreduce(torch.ones(4, dtype=torch.int32), ReduceOp.AVG)


def test_bitwise_on_floats_is_refused(comm):
    with pytest.raises(ValueError, match=exact(
            "BXOR is bitwise and float64 is a floating-point dtype; bitwise reductions take "
            "integer or bool buffers (view the bits as an integer dtype of the same width if "
            "that is what you mean)")):
        comm.allreduce(np.ones(4), ReduceOp.BXOR)


def test_op_must_be_a_reduce_op(comm):
    with pytest.raises(TypeError, match=exact(
            "op must be a mcrdl.ReduceOp (e.g. ReduceOp.SUM), got 'sum'")):
        comm.allreduce(torch.ones(4), "sum")


def test_unknown_and_unavailable_backends(backends):
    runtime = Runtime(Config(progress_thread=False), None, {"mpi": backends["mpi"]})
    comm = runtime.world
    with pytest.raises(UnknownBackendError, match=exact("unknown backend 'ncl'; known: cupy-nccl, gloo, mpi, nccl, sim")):
        comm.allreduce(torch.ones(4), backend="ncl")
    with pytest.raises(BackendUnavailableError, match=exact(
            "backend 'gloo' is not available in this runtime; available: mpi")):
        comm.allreduce(torch.ones(4), backend="gloo")
    with pytest.raises(UnknownBackendError, match=exact("unknown backend 'ncl'; known: cupy-nccl, gloo, mpi, nccl, sim")):
        mcrdl.backends.backend_class("ncl")


def test_split_arguments(comm):
    with pytest.raises(ValueError, match=exact("color=-2 must be a non-negative int or None")):
        comm.split(-2)
    with pytest.raises(TypeError, match=exact("key must be an int, got 'a'")):
        comm.split(0, key="a")


def test_closed_communicator_and_finalized_runtime(backends):
    allow_started(backends)
    runtime = Runtime(Config(progress_thread=False), None, backends)
    comm = runtime.world
    fut = comm.allreduce(torch.ones(4))
    assert fut.state == "ISSUED"
    # finalize drains: this operation never finishes, so the drain runs into its timeout
    runtime.engine.timeout = None
    for b in backends.values():
        for req in b.started:
            b.finish(req)
    runtime.finalize()
    assert fut.state == "DONE"
    with pytest.raises(CommClosedError, match=exact(
            "cannot allreduce on world: the runtime was finalized")):
        comm.allreduce(torch.ones(4))


def test_waiting_on_a_future_of_a_finalized_runtime(backends):
    allow_started(backends)
    runtime = Runtime(Config(progress_thread=False), None, backends)
    fut = runtime.world.barrier()
    # finalize cannot drain an operation that never finishes: fail it instead
    runtime.engine.fail_all(
        lambda f: RuntimeFinalizedError(f"the runtime was finalized before {f!r} finished"))
    runtime.finalize()
    with pytest.raises(RuntimeFinalizedError, match=r"^the runtime was finalized before "
                                                    r"<CommFuture barrier#1 "):
        fut.wait()


def test_op_on_a_closed_sub_communicator(backends):
    allow_started(backends)
    runtime = Runtime(Config(progress_thread=False), None, backends)
    sub = runtime.make_communicator(runtime.world, "world.1c0", [0, 1, 2, 3])
    sub.close()
    with pytest.raises(CommClosedError, match=r"^cannot barrier on <Communicator world.1c0 "
                                              r"rank=1/4 backends=mpi,gloo closed>: the "
                                              r"communicator is closed$"):
        sub.barrier()


def test_a_bad_name_is_refused_before_anything_is_submitted():
    """alltoallv names its counts exchange after the data exchange: a bad name must raise
    before that exchange is submitted (it would wait for agreement forever)."""
    with mcrdl.init() as comm:
        engine = comm.runtime.engine
        before = engine.stats().submitted
        with pytest.raises(TypeError, match="name must be a str"):
            comm.alltoallv(np.ones(1), [1], name=3)
        with pytest.raises(ValueError, match="non-empty string"):
            comm.allreduce(np.ones(1), name="")
        assert engine.stats().submitted == before


def test_a_tensor_on_a_device_no_backend_reaches(comm):
    # (a "meta" tensor stands for any device memory these backends do not reach)
    with pytest.raises(UnsupportedOperationError,
                       match=r"no backend in this runtime can allreduce float32 with SUM on meta"):
        comm.allreduce(torch.empty(4, device="meta"))
    with pytest.raises(UnsupportedOperationError,
                       match=r"mpi cannot reach meta \(it reaches cpu\); backends that can: none"):
        comm.broadcast(torch.empty(4, device="meta"), backend="mpi")


class _CudaArray:
    """What numba's device arrays expose: the CUDA Array Interface (no memory behind it here:
    mcrdl refuses it before reading any)."""

    def __init__(self, readonly=False):
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4",
                                         "data": (0x1000, readonly), "version": 3}


class _DLPackArray:
    """What cupy arrays expose besides: DLPack, with the device they are on."""

    def __init__(self, device_type):
        self.device_type = device_type

    def __dlpack__(self, stream=None):
        raise AssertionError("not to be read here")

    def __dlpack_device__(self):
        return (self.device_type, 0)


def test_arrays_in_cuda_memory_need_a_cuda_torch(comm):
    # Taken as the torch tensor sharing their memory; this torch has no CUDA device.
    for array in (_CudaArray(), _DLPackArray(2)):
        with pytest.raises(TypeError, match=r"buf is a tests\.test_front_errors\._\w+ in CUDA "
                                            r"memory, .* this torch sees no CUDA device"):
            comm.allreduce(array)


def test_a_read_only_cuda_array_is_refused_where_written(comm):
    with pytest.raises(ValueError, match=r"buf is read-only but this operation writes it"):
        comm.allreduce(_CudaArray(readonly=True))
    with pytest.raises(TypeError, match=r"no CUDA device"):  # read only: passes that check
        comm.alltoall(_CudaArray(readonly=True))


def test_a_dlpack_array_on_the_host_is_not_taken_for_a_cuda_one(comm):
    with pytest.raises(TypeError, match=r"must be a torch.Tensor or numpy.ndarray"):
        comm.allreduce(_DLPackArray(1))  # kDLCPU


def test_a_buffer_knows_the_bytes_it_covers():
    from mcrdl.core._buffers import as_buffer

    base = np.arange(32, dtype=np.float64)
    view = base[5:9]  # writable: its address through the buffer protocol
    readonly = base[5:9].view()
    readonly.flags.writeable = False  # read-only: through __array_interface__
    for arr in (view, readonly):
        b = as_buffer(arr, "buf")
        assert b.addr == arr.__array_interface__["data"][0] == base.ctypes.data + 5 * 8
        assert b.ranges == ((b.addr, b.addr + 32),) and b.device == "cpu"
    t = torch.arange(8.0)[2:6]
    assert as_buffer(t, "buf").ranges == ((t.data_ptr(), t.data_ptr() + 16),)


def test_a_torch_work_future_is_refused_without_a_progress_thread(comm, backends):
    """torch waits on ``Work.get_future()`` in C++ (DDP's reducer), where nothing polls the
    engine: without the progress thread it would never complete, so it is refused by name;
    ``Work.wait()`` drives the engine itself, and a future of finished work is given."""
    from mcrdl.torch._group import _Work

    allow_started(backends)
    t = torch.ones(4)
    work = _Work([comm.allreduce(t, backend="mpi")], [t])
    with pytest.raises(mcrdl.MCRDLError, match=r"^Work\.get_future\(\) needs mcrdl's progress "
                                               r"thread, and this runtime has none"):
        work.get_future()
    mpi = backends["mpi"]
    mpi.finish(mpi.started[0])
    assert work.wait() and work.get_future().wait() == [t]


def test_a_torch_works_completion_query_moves_the_engine(comm, backends):
    """``Work.is_completed()`` polls the engine once, as torch's NCCL work queries its events:
    a loop over it ends without the progress thread (this runtime has none)."""
    from mcrdl.torch._group import _Work

    allow_started(backends)
    work = _Work([comm.allreduce(torch.ones(4), backend="mpi")], [])
    assert not work.is_completed()
    mpi = backends["mpi"]
    mpi.finish(mpi.started[0])  # the backend is done; nothing has polled since
    assert work.is_completed() and work.is_success()
