"""Sweeps: every operation x size x dtype x backend, timed the way nccl-tests times them.

Sizes are *global* message sizes (see ``_table``). For every point all ranks run the same
number of iterations, decided by rank 0 from the warm-up and broadcast (a rank deciding for
itself from its own timings would desynchronize the ranks); a point's time is the median
over iterations of the slowest rank. Raw mpi4py (blocking calls on the same buffers' numpy
views) and raw torch.distributed (gloo; NCCL for CUDA buffers) can be measured in the same
run, as baselines.

On a GPU (``device="cuda"``) the buffers are CUDA tensors: mcrdl's ``.wait()`` returns once
the operation has run on the device, and a raw torch.distributed call is followed by
``torch.cuda.synchronize()`` so that both are timed to the same point. Raw mpi4py is left
out there (this MPI is not given device memory).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from ..core._errors import MCRDLError
from ..core._types import DType, ReduceOp

__all__ = ["BUS_FACTOR", "OPS", "Point", "RAW_MPI", "RAW_TORCH", "sweep"]

OPS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter",
       "alltoall", "alltoallv", "barrier")
RAW_MPI = "raw-mpi4py"
RAW_TORCH = "raw-torch"
_REDUCING = ("allreduce", "reduce", "reduce_scatter")
_ROOTED = ("broadcast", "reduce", "gather", "scatter")


def BUS_FACTOR(op: str, n: int) -> float:  # noqa: N802 - a table, read like one
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks."""
    if n <= 1:
        return 1.0
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


@dataclass
class Point:
    """One measured point: a backend's time for one operation at one global size."""

    op: str
    dtype: str
    nbytes: int
    count: int
    backend: str
    time_us: float
    algbw: float
    busbw: float
    iters: int
    root: int
    redop: str
    device: str = "cpu"

    def as_dict(self) -> dict[str, Any]:
        """The point as a flat dict (CSV and JSON rows)."""
        return asdict(self)


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else int(np.dtype(dtype).itemsize)


def _elements(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Elements per rank's input for a global size (rounded so that chunks divide)."""
    total = max(1, nbytes // itemsize)
    if op == "alltoallv":  # equal counts, so that every rank receives what it expects
        return max(n, total // n // n * n)
    if op in ("allgather", "gather"):
        return max(1, total // n)
    if op in ("scatter", "reduce_scatter", "alltoall"):
        return max(n, total // n * n)
    return total


def _out_elements(op: str, elems: int, n: int) -> int:
    if op in ("allgather", "gather"):
        return elems * n
    if op in ("scatter", "reduce_scatter"):
        return elems // n
    return elems


def _global_bytes(op: str, elems: int, itemsize: int, n: int) -> int:
    if op in ("allgather", "gather", "alltoallv"):
        return elems * itemsize * n
    if op == "barrier":
        return 0
    return elems * itemsize


def _gpus_shared(comm: Any) -> bool:
    """Whether two ranks use one GPU (same host, same device UUID), through the bootstrap
    store (collective)."""
    import socket

    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    me = f"{socket.gethostname()}/{getattr(props, 'uuid', torch.cuda.current_device())}"
    store = comm.runtime.bootstrap.store()
    keys = [f"mcrdl/bench/gpu/{r}" for r in range(comm.size)]
    store.set(keys[comm.rank], me)
    store.wait(keys)
    seen = [store.get(k).decode() for k in keys]
    return len(set(seen)) < len(seen)


class _Raw:
    """The raw baselines' callables for one point (None where a baseline cannot run it)."""

    def __init__(self, comm: Any, device: str = "cpu") -> None:
        self.comm = comm
        self.device = device
        self.mpi = None
        if "mpi" in comm.backends:
            from mpi4py import MPI

            self.MPI = MPI
            self.mpi = MPI.COMM_WORLD.Dup()
        self.dist = None
        import torch.distributed as dist

        if "gloo" in comm.backends or device != "cpu":
            if not dist.is_initialized():
                import torch

                store = dist.PrefixStore(  # type: ignore[attr-defined]
                    "mcrdl/bench/raw", comm.runtime.bootstrap.store())
                # (NCCL connects at its first call: nothing is paid on a host-only sweep)
                gpu = torch.cuda.is_available() and dist.is_nccl_available()
                dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", store=store,
                                        rank=comm.rank, world_size=comm.size)
            self.dist = dist
            if device != "cpu" and _gpus_shared(comm):
                # torch.distributed's CUDA baseline is NCCL, which refuses two ranks on one GPU
                # ("Duplicate GPU detected"): no raw-torch points then.
                self.dist = None
                if comm.rank == 0:
                    print("raw-torch: left out on cuda, where ranks share a GPU (its NCCL needs "
                          "one GPU per rank)", file=sys.stderr)

    def mpi_call(self, op: str, t: Any, out: Any, redop: ReduceOp) -> Callable[[], Any] | None:
        if self.mpi is None or self.device != "cpu":
            return None
        import torch

        MPI, c = self.MPI, self.mpi
        if t.dtype == torch.bfloat16:
            if op in _REDUCING:
                return None  # raw MPI has no bfloat16 reduction
            t, out = t.view(torch.int16), out.view(torch.int16)
        a, o = t.numpy(), out.numpy()
        mop = {ReduceOp.SUM: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN,
               ReduceOp.PROD: MPI.PROD}.get(redop, MPI.SUM)
        n = c.size
        calls = {
            "allreduce": lambda: c.Allreduce(MPI.IN_PLACE, a, mop),
            "broadcast": lambda: c.Bcast(a, 0),
            "reduce": lambda: c.Reduce(MPI.IN_PLACE if c.rank == 0 else a,
                                       a if c.rank == 0 else None, mop, 0),
            "allgather": lambda: c.Allgather(a, o),
            "gather": lambda: c.Gather(a, o if c.rank == 0 else None, 0),
            "scatter": lambda: c.Scatter(a if c.rank == 0 else None, o, 0),
            "reduce_scatter": lambda: c.Reduce_scatter_block(a, o, mop),
            "alltoall": lambda: c.Alltoall(a, o),
            "alltoallv": lambda: c.Alltoallv([a, _split(a.size, n)], [o, _split(a.size, n)]),
            "barrier": lambda: c.Barrier(),
        }
        return calls[op]

    def torch_call(self, op: str, t: Any, out: Any, redop: ReduceOp) -> Callable[[], Any] | None:
        d = self.dist
        if d is None:
            return None
        n = self.comm.size
        rop = {ReduceOp.SUM: d.ReduceOp.SUM, ReduceOp.MAX: d.ReduceOp.MAX,
               ReduceOp.MIN: d.ReduceOp.MIN, ReduceOp.PROD: d.ReduceOp.PRODUCT}.get(
            redop, d.ReduceOp.SUM)
        rank = self.comm.rank
        # The *_single names where torch has them: their deprecated aliases warn on every call.
        gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        scatter_reduce = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
        calls = {
            "allreduce": lambda: d.all_reduce(t, rop),
            "broadcast": lambda: d.broadcast(t, 0),
            "reduce": lambda: d.reduce(t, 0, rop),
            "allgather": lambda: gather(out, t),
            "gather": lambda: d.gather(t, list(out.chunk(n)) if rank == 0 else None, 0),
            "scatter": lambda: d.scatter(out, list(t.chunk(n)) if rank == 0 else None, 0),
            "reduce_scatter": lambda: scatter_reduce(out, t, rop),
            "alltoall": lambda: d.all_to_all_single(out, t),
            "alltoallv": lambda: d.all_to_all_single(out, t, _split(t.numel(), n)[0],
                                                     _split(t.numel(), n)[0]),
            "barrier": lambda: d.barrier(),
        }
        if self.device == "cpu":
            return calls[op]
        import torch

        if op == "barrier":  # (torch's barrier would run on gloo: one element on NCCL)
            one = torch.ones(1, device=t.device)
            calls[op] = lambda: d.all_reduce(one)
        call: Callable[[], Any] = calls[op]

        sync = torch.cuda.synchronize

        def on_device() -> None:  # (NCCL returns once the work is queued)
            call()
            sync()

        return on_device


def _mcrdl_call(comm: Any, op: str, t: Any, out: Any, redop: ReduceOp,
                backend: str | None) -> Callable[[], Any]:
    n = comm.size
    kw = {"backend": backend}
    if op == "allreduce":
        return lambda: comm.allreduce(t, redop, **kw).wait()
    if op == "broadcast":
        return lambda: comm.broadcast(t, 0, **kw).wait()
    if op == "reduce":
        return lambda: comm.reduce(t, 0, redop, **kw).wait()
    if op == "allgather":
        return lambda: comm.allgather(t, out=out, **kw).wait()
    if op == "gather":
        return lambda: comm.gather(t, 0, out=out if comm.rank == 0 else None, **kw).wait()
    if op == "scatter":
        return lambda: comm.scatter(t, 0, out=out, **kw).wait()
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(t, redop, out=out, **kw).wait()
    if op == "alltoall":
        return lambda: comm.alltoall(t, out=out, **kw).wait()
    if op == "alltoallv":
        counts = _split(t.numel(), n)[0]
        return lambda: comm.alltoallv(t, counts, counts, out=out, **kw).wait()
    return lambda: comm.barrier(**kw).wait()


def _split(total: int, n: int) -> tuple[list[int], list[int]]:
    """Counts and displacements splitting ``total`` elements into ``n`` near-equal parts."""
    counts = [total // n] * n
    counts[-1] += total - sum(counts)
    displs = [sum(counts[:i]) for i in range(n)]
    return counts, displs


def _timed(comm: Any, call: Callable[[], Any], warmup: int, budget: float,
           max_iters: int) -> tuple[float, int]:
    """(slowest rank's median seconds, iterations): the count is rank 0's, for everyone."""
    control = comm.runtime.control_of(comm.backends)
    comm.barrier(backend=control).wait()
    t0 = time.perf_counter()
    for _ in range(warmup):
        call()
    per = (time.perf_counter() - t0) / max(1, warmup)
    want = np.array([min(max_iters, max(3, int(budget / max(per, 1e-7))))], dtype=np.int64)
    comm.broadcast(want, 0, backend=control).wait()
    iters = int(want[0])
    comm.barrier(backend=control).wait()
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        s = clock()
        call()
        samples.append(clock() - s)
    med = np.array([statistics.median(samples)], dtype=np.float64)
    comm.allreduce(med, ReduceOp.MAX, backend=control).wait()
    return float(med[0]), iters


def sweep(
    comm: Any,
    ops: Sequence[str],
    sizes: Sequence[int],
    dtypes: Sequence[str],
    backends: Sequence[str | None],
    *,
    raw: bool = True,
    redop: ReduceOp = ReduceOp.SUM,
    warmup: int = 5,
    budget: float = 0.2,
    max_iters: int = 10000,
    progress: bool | None = False,
    device: str = "cpu",
) -> list[Point]:
    """Measure every (op, size, dtype, backend); ``None`` in ``backends`` means auto.

    ``progress``: a progress bar on rank 0's stderr (None: only when that is a terminal;
    under ``mpiexec`` it is a pipe to the launcher, so ``True`` is what shows it there).

    ``device``: where the buffers are (``"cpu"``, ``"cuda"``: the current GPU). Points a
    backend cannot run (a dtype it cannot reduce, a device it cannot reach) are left out.

    Raises:
        ValueError: ``device`` is not ``"cpu"`` or ``"cuda"``, or there is no GPU here.
    """
    import torch

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: sweeps run on 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda', but torch sees no CUDA device here")
    where = torch.device(device, torch.cuda.current_device()) if device == "cuda" else device

    n = comm.size
    plan = [(op, dtype, size) for op in ops for dtype in dtypes
            for size in (sizes if op != "barrier" else [0])]
    rawer = _Raw(comm, device) if raw else None
    points: list[Point] = []
    # Rank 0 only; disable=None is tqdm's "only on a terminal".
    bar = tqdm(total=len(plan), file=sys.stderr, unit="point", dynamic_ncols=True,
               disable=True if comm.rank != 0 or progress is False
               else None if progress is None else False)
    for op, dtype, size in plan:
        itemsize = _itemsize(dtype)
        elems = _elements(op, size, itemsize, n) if op != "barrier" else 1
        tdtype = getattr(torch, dtype)
        t = torch.zeros(elems, dtype=tdtype, device=where)
        out = torch.zeros(_out_elements(op, elems, n), dtype=tdtype, device=where)
        nbytes = _global_bytes(op, elems, itemsize, n)
        candidates: list[tuple[str, Callable[[], Any] | None]] = [
            (b or "auto", _mcrdl_call(comm, op, t, out, redop, b)) for b in backends]
        if rawer is not None:
            candidates.append((RAW_MPI, rawer.mpi_call(op, t, out, redop)))
            candidates.append((RAW_TORCH, rawer.torch_call(op, t, out, redop)))
        for name, call in candidates:
            if call is None or not _runs(comm, name, op, dtype, redop, str(t.device)):
                continue
            seconds, iters = _timed(comm, call, warmup, budget, max_iters)
            us = seconds * 1e6
            algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            points.append(Point(op, dtype, nbytes, elems, name, round(us, 3), round(algbw, 4),
                                round(algbw * BUS_FACTOR(op, n), 4), iters,
                                0 if op in _ROOTED else -1,
                                redop.value if op in _REDUCING else "none", device))
        bar.set_postfix_str(f"{op} {dtype} {size}B", refresh=False)
        bar.update()
    bar.close()
    return points


def _runs(comm: Any, name: str, op: str, dtype: str, redop: ReduceOp, device: str) -> bool:
    """Whether mcrdl can run this point on backend ``name`` with buffers on ``device`` (the
    raw ones: always)."""
    if name in (RAW_MPI, RAW_TORCH):
        return True
    from ..core._types import OpKind

    try:
        comm._selector.choose(comm._slots, OpKind(op), DType(dtype) if op != "barrier" else None,
                              redop if op in _REDUCING else None,
                              None if name == "auto" else name, comm.size, device)
    except MCRDLError:
        return False
    return True
