"""GPU lanes on a real CUDA device: NCCL through the engine, ordered by streams and events.

Marked ``gpu`` (the default run leaves them out) and skipped where CUDA is missing. One GPU
allows one NCCL rank, so these run a world of one process: every operation on the ``nccl``
backend against what it must produce, stream ordering with no host synchronization between a
kernel and the operation that reads what it wrote, ``wait_stream``, and a tensor dropped
while in flight. ``tests/gpu/run.sh`` runs them (and the GPU benchmarks) on a machine
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
from mcrdl.backends.cupy_nccl import CupyNCCLBackend  # noqa: E402

#: Cycles of torch.cuda._sleep that make a kernel outlast any race (~1 ms on an H200).
SLOW = 2_000_000


def _mpi_loads():
    """Whether mpi4py finds an MPI library here (a machine may have mpi4py without one)."""
    try:
        from mcrdl.bootstrap._launch import import_mpi

        import_mpi()
    except Exception:  # noqa: BLE001 - no usable MPI: the MPI cases skip
        return False
    return True


@pytest.fixture(scope="module")
def comm():
    torch.cuda.set_device(0)
    mpi = ["mpi"] if _mpi_loads() else []
    cupy = ["cupy-nccl"] if CupyNCCLBackend.is_available() else []
    world = mcrdl.init(backends=["gloo", "nccl", *mpi, *cupy])
    yield world
    mcrdl.finalize()


def test_nccl_first_and_gloo_staged(comm):
    x = torch.ones(4, device="cuda")
    fut = comm.allreduce(x)
    # A stream-ordered backend first for device memory (nccl, or cupy-nccl where cupy is up).
    assert comm.runtime.backend(fut.lane.backend_name).capabilities.stream_ordered
    fut.wait()
    caps = comm.runtime.backend("gloo").capabilities
    assert "cuda" in caps.devices and caps.staged == frozenset({"cuda"})


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_every_operation_staged_through_host_memory(comm, backend):
    """gloo, and MPI without CUDA support, on CUDA tensors: copied to pinned host memory on
    a copy stream after the caller's work, and back before the operation is done (a
    CUDA-aware MPI gets them as they are: the same results)."""
    _up(comm, backend)
    x = torch.zeros(1 << 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)  # the caller's stream is busy...
    x.fill_(3.0)  # ...then writes the input; no host synchronization from here on
    out = comm.allgather(x, backend=backend).wait()
    assert out.device == x.device and bool((out == 3.0).all())
    y = torch.arange(8.0, device="cuda")
    assert torch.equal(comm.allreduce(y.clone(), backend=backend).wait(), y)
    assert torch.equal(comm.broadcast(y.clone(), backend=backend).wait(), y)
    assert torch.equal(comm.alltoall(y, backend=backend).wait(), y)
    assert torch.equal(comm.reduce_scatter(y, backend=backend).wait(), y)
    assert torch.equal(comm.alltoallv(y, [8], [8], backend=backend).wait(), y)
    assert torch.equal(comm.allreduce(y.clone(), mcrdl.ReduceOp.AVG, backend=backend).wait(), y)


def test_mpi_reaches_the_gpu_the_way_its_library_says(comm):
    """A CUDA-aware MPI (its ``mpi_memory_alloc_kinds`` name ``cuda``) gets CUDA tensors as
    they are, but for its half-precision reductions (a host callback: staged); any other MPI
    gets everything staged. Both give the same results."""
    _up(comm, "mpi")
    mpi = comm.runtime.backend("mpi")
    caps = mpi.capabilities
    if mpi.cuda_aware:
        assert caps.direct == frozenset({"cuda"}) and "cuda" not in caps.staged
    else:
        assert caps.staged == frozenset({"cuda"}) and not caps.direct
    x = torch.zeros(1 << 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)
    x.fill_(3.0)  # written on the caller's stream after a long kernel: read after it
    assert bool((comm.allreduce(x, backend="mpi").wait() == 3.0).all())
    h = torch.arange(8, dtype=torch.float16, device="cuda")
    assert torch.equal(comm.allreduce(h.clone(), backend="mpi").wait(), h)
    b = torch.arange(8, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(comm.reduce_scatter(b, backend="mpi").wait(), b)


def _up(comm, backend):
    if backend not in comm._slots:
        pytest.skip(f"{backend} is not up here (not installed)")


@pytest.mark.parametrize("backend", ["nccl", "cupy-nccl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_operation_on_nccl(comm, dtype, backend):
    _up(comm, backend)
    dev = "cuda"
    x = torch.arange(8, device=dev).to(dtype)
    assert torch.equal(comm.allreduce(x.clone(), backend=backend).wait(), x)
    assert torch.equal(comm.broadcast(x.clone(), backend=backend).wait(), x)
    assert torch.equal(comm.reduce(x.clone(), backend=backend).wait(), x)
    assert torch.equal(comm.allgather(x, backend=backend).wait(), x)
    assert torch.equal(comm.gather(x, backend=backend).wait(), x)
    assert torch.equal(comm.scatter(x, backend=backend).wait(), x)
    assert torch.equal(comm.reduce_scatter(x, backend=backend).wait(), x)
    assert torch.equal(comm.alltoall(x, backend=backend).wait(), x)
    assert torch.equal(comm.alltoallv(x, [8], [8], backend=backend).wait(), x)
    comm.barrier(backend=backend).wait()
    if dtype.is_floating_point:
        assert torch.equal(comm.allreduce(x.clone(), mcrdl.ReduceOp.AVG, backend=backend).wait(),
                           x)


@pytest.mark.parametrize("backend", ["nccl", "cupy-nccl"])
def test_an_operation_reads_what_a_kernel_queued_before_it_wrote(comm, backend):
    _up(comm, backend)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)  # the caller's stream is busy...
    x.fill_(3.0)  # ...then writes the input; no host synchronization from here on
    out = comm.allgather(x, backend=backend).wait()
    assert bool((out == 3.0).all())


def test_the_lanes_stream_waits_for_the_nccl_collective(comm):
    """The engine's end event for an operation (what ``wait_stream`` and dependants on other
    streams wait for) is recorded on the lane's stream right after the call: it marks the
    collective's end only if that stream was made to wait for it (ProcessGroupNCCL queues it
    on a stream of its own; ``Work.wait()`` does that). A 1-rank allgather of 1 GiB copies
    for ~0.5 ms: an event recorded behind it on the lane's stream is reached only once the
    Work is complete."""
    from mcrdl.core._buffers import as_buffer

    nccl = comm.runtime.backend("nccl")
    group = nccl.world()
    x = torch.ones(1 << 28, device="cuda")
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    work = nccl.start_allgather(group, as_buffer(x, "x"), as_buffer(out, "out", writable=True))
    end = nccl.device.record(group.stream)
    end.synchronize()
    assert work.is_completed()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # given back as it was
    del x, out


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


def test_a_sweep_on_the_gpu_against_raw_nccl(comm):
    from mcrdl.tuning import TuningTable
    from mcrdl.tuning._bench import sweep

    points = sweep(comm, ["allreduce", "alltoall"], [4, 1 << 20], ["float32"],
                   ["nccl", "gloo", None], budget=0.01, warmup=2, device="cuda")
    names = {(p.op, p.backend) for p in points}
    for op in ("allreduce", "alltoall"):
        assert {(op, "nccl"), (op, "gloo"), (op, "auto"), (op, "raw-torch")} <= names
    assert {p.device for p in points} == {"cuda"}
    assert not [p for p in points if p.backend == "raw-mpi4py"]  # MPI gets no device memory
    latencies = {}
    for p in points:
        if p.backend in ("nccl", "gloo"):
            latencies.setdefault((p.op, p.dtype, 1, p.nbytes), {})[p.backend] = p.time_us
    table = TuningTable.from_measurements(latencies, device="cuda")
    assert table.lookup("allreduce", "float32", 1, 4, device="cuda") in ("nccl", "gloo")


def test_cupy_arrays_are_taken_in_place(comm):
    cupy = pytest.importorskip("cupy")
    f32 = cupy.float32
    x = cupy.ones(4, dtype=f32)
    assert comm.allreduce(x).wait() is x  # nccl first; resolves to the caller's array
    assert float(x.sum()) == 4.0
    y = cupy.full(4, 2.0, dtype=f32)
    assert comm.allreduce(y, backend="gloo").wait() is y  # staged
    assert float(y.sum()) == 8.0
    # An output mcrdl allocates is a torch tensor (cupy.from_dlpack(out): zero-copy).
    out = comm.allgather(cupy.arange(4, dtype=f32)).wait()
    assert torch.equal(out.cpu(), torch.arange(4.0))
    # An out the caller passes is filled in place.
    o = cupy.zeros(4, dtype=f32)
    comm.alltoall(cupy.arange(4, dtype=f32), out=o).wait()
    assert bool(cupy.array_equal(o, cupy.arange(4, dtype=f32)))
    # Written by a kernel on cupy's own stream, read after it: DLPack orders torch's current
    # stream (the operation's caller stream) after cupy's.
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        z = cupy.zeros(1 << 22, dtype=f32)
        for _ in range(20):
            z += 1
        fut = comm.allreduce(z, backend="gloo")
    fut.wait()
    assert float(z.min()) == 20.0


@pytest.mark.parametrize(("launcher", "ranks"), [("torchrun", 2), ("mpi", 2), ("mpi", 4)])
def test_ranks_share_one_gpu_over_staged_host_backends(launcher, ranks):
    from pathlib import Path

    from tests.launch import mpiexec, run_ranks

    if launcher == "mpi":
        if not _mpi_loads():
            pytest.skip("mpi4py finds no MPI library here")
        try:
            mpiexec()
        except RuntimeError:
            pytest.skip("no mpiexec here")
    backends = "gloo" if launcher == "torchrun" else "mpi,gloo"
    script = str(Path(__file__).with_name("shared_gpu.py"))
    proc = run_ranks(ranks, [script, backends], timeout=180, launcher=launcher)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert f"shared GPU ok: {ranks} ranks" in proc.stdout
