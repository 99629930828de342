"""GPU lanes on a real CUDA device: NCCL through the engine, ordered by streams and events.

Marked ``gpu`` (the default run leaves them out) and skipped where CUDA is missing. One GPU
allows one NCCL rank, so these run a world of one process: every operation on the ``nccl``
backend against what it must produce, stream ordering with no host synchronization between a
kernel and the operation that reads what it wrote, ``wait_stream``, and a tensor dropped
while in flight. ``tests/gpu/run.sh`` runs them (and ``benchmarks/gpu_lanes.py``) on a machine
with a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

import mcrdl  # noqa: E402

#: Cycles of torch.cuda._sleep that make a kernel outlast any race (~1 ms on an H200).
SLOW = 2_000_000


@pytest.fixture(scope="module")
def comm():
    torch.cuda.set_device(0)
    world = mcrdl.init(backends=["gloo", "nccl"])
    yield world
    mcrdl.finalize()


def test_the_device_is_reached_by_nccl_only(comm):
    x = torch.ones(4, device="cuda")
    fut = comm.allreduce(x)
    assert fut.lane.backend_name == "nccl"  # a stream-ordered backend first for device memory
    fut.wait()
    with pytest.raises(mcrdl.UnsupportedOperationError, match="gloo cannot reach cuda:0"):
        comm.allreduce(x, backend="gloo")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_operation_on_nccl(comm, dtype):
    dev = "cuda"
    x = torch.arange(8, device=dev).to(dtype)
    assert torch.equal(comm.allreduce(x.clone(), backend="nccl").wait(), x)
    assert torch.equal(comm.broadcast(x.clone(), backend="nccl").wait(), x)
    assert torch.equal(comm.reduce(x.clone(), backend="nccl").wait(), x)
    assert torch.equal(comm.allgather(x, backend="nccl").wait(), x)
    assert torch.equal(comm.gather(x, backend="nccl").wait(), x)
    assert torch.equal(comm.scatter(x, backend="nccl").wait(), x)
    assert torch.equal(comm.reduce_scatter(x, backend="nccl").wait(), x)
    assert torch.equal(comm.alltoall(x, backend="nccl").wait(), x)
    assert torch.equal(comm.alltoallv(x, [8], [8], backend="nccl").wait(), x)
    comm.barrier(backend="nccl").wait()
    if dtype.is_floating_point:
        assert torch.equal(comm.allreduce(x.clone(), mcrdl.ReduceOp.AVG, backend="nccl").wait(),
                           x)


def test_an_operation_reads_what_a_kernel_queued_before_it_wrote(comm):
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)  # the caller's stream is busy...
    x.fill_(3.0)  # ...then writes the input; no host synchronization from here on
    out = comm.allgather(x, backend="nccl").wait()
    assert bool((out == 3.0).all())


def test_wait_stream_orders_a_consumer_without_blocking_the_host(comm):
    x = torch.ones(1 << 20, device="cuda")
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)
    x.mul_(5.0)
    fut = comm.allgather(x, out=out, backend="nccl")
    fut.wait_stream()
    assert not fut.done()  # the host went on while the device still sleeps
    y = out * 2  # queued on the caller's stream, behind the operation
    torch.cuda.synchronize()
    assert bool((y == 10.0).all())


def test_a_tensor_dropped_in_flight_is_not_reused_early(comm):
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)
    x = torch.full((1 << 20,), 7.0, device="cuda")
    fut = comm.allgather(x, backend="nccl")
    del x  # the caching allocator must not hand its memory out while the operation reads it
    others = [torch.full((1 << 20,), -1.0, device="cuda") for _ in range(4)]
    assert bool((fut.wait() == 7.0).all())
    del others
