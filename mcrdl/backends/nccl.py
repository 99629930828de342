"""The nccl backend: torch.distributed's ProcessGroupNCCL, on a stream of mcrdl's per communicator.

Brought up only when asked for (``init(backends=["mpi", "gloo", "nccl"])`` or
``MCRDL_BACKENDS``), on the GPU that is current when ``init()`` runs (call
``torch.cuda.set_device(local_rank)`` first): NCCL refuses two ranks on one GPU.

How it orders work (``Capabilities.stream_ordered``):
- each group has a stream of its own (``stream``); an operation is called with that stream
  current, so ProcessGroupNCCL's internal stream waits for it (the engine made it wait for the
  caller's stream and for the operations this one depends on), and the Work's ``wait()``,
  called right after, makes the group's stream wait for the collective's end: work queued on
  the group's stream afterwards runs after it. Neither call blocks the host (without
  ``TORCH_NCCL_BLOCKING_WAIT``). (Options with ``asyncOp`` false, which put the collective
  on the current stream, were tried: torch 2.11 then returns no Work, so nothing tells the
  engine when the collective has finished.)
- completion is ``Work.is_completed()``, a query of NCCL's end event.
- ProcessGroupNCCL records the tensors on its stream for the caching allocator, and the engine
  holds them until the operation has finished: a tensor the caller drops is not reused early.

Quirks beyond the contract:
- Process groups are made from the runtime's store under a prefix per communicator, by the
  members alone, and connected at once (``eager_connect_single_device``): NCCL's communicator
  set-up blocks until every member arrives, which group creation may, an operation may not.
- Point-to-point is left to the host backends: NCCL matches sends and receives by order per
  peer, never by tag, where mcrdl matches them by peer and tag.
- A barrier is an allreduce of one element on the device (ProcessGroupNCCL's own barrier
  blocks the host in ``wait()``).
- NCCL cannot cancel an operation; a communicator mcrdl gives up on is aborted
  (``abandon``), which ends its kernels on this rank so that its stream does not stay blocked.
- NCCL's asynchronous errors are torch's watchdog's business (it aborts the process by
  default); ``test`` reports a Work that raises.
"""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core._errors import BackendError
from ..core._types import DType, OpKind, ReduceOp
from ._contract import Backend, Capabilities, Rendezvous, Request

if TYPE_CHECKING:
    from ..core._buffers import Buffer

__all__ = ["NCCLBackend"]

_MOVED = frozenset({DType.BOOL, DType.UINT8, DType.INT8, DType.INT32, DType.INT64,
                    DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
_NUMERIC = _MOVED - {DType.BOOL}
_FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})


class _NCCLGroup:
    __slots__ = ("pg", "rank", "size", "stream")

    def __init__(self, pg: Any, rank: int, size: int, stream: Any) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size
        self.stream = stream

    def __repr__(self) -> str:
        return f"<nccl group rank={self.rank}/{self.size}>"


class NCCLBackend(Backend):
    """NCCL through torch.distributed (see the module docstring)."""

    name = "nccl"
    capabilities = Capabilities(
        ops=frozenset(OpKind) - {OpKind.SEND, OpKind.RECV},
        dtypes=_MOVED,
        reductions={ReduceOp.SUM: _NUMERIC, ReduceOp.PROD: _NUMERIC, ReduceOp.MIN: _NUMERIC,
                    ReduceOp.MAX: _NUMERIC, ReduceOp.AVG: _FLOATS},
        devices=frozenset({"cuda"}),
        stream_ordered=True,
        in_order=True,
    )

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch") is None:
            return False
        try:
            import torch
            import torch.distributed as dist

            return bool(dist.is_available() and dist.is_nccl_available()
                        and torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - is_available never raises
            return False

    def __init__(self, bootstrap: Rendezvous) -> None:
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroupNCCL

        from ._cuda import CudaDevice

        self._torch = torch
        self._dist = dist
        self._PG = ProcessGroupNCCL
        self._store = bootstrap.store()
        self._timeout = datetime.timedelta(seconds=bootstrap.timeout)
        self.device = CudaDevice(torch.cuda.current_device())
        self._cuda_device = torch.device("cuda", self.device.index)
        red = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.PROD: dist.ReduceOp.PRODUCT,
               ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
               ReduceOp.AVG: dist.ReduceOp.AVG}
        self._red = red
        self._world = self._make(f"world/{bootstrap.size}", bootstrap.rank, bootstrap.size)

    def _make(self, tag: str, rank: int, size: int) -> _NCCLGroup:
        opts = self._PG.Options()
        opts._timeout = self._timeout
        store = self._dist.PrefixStore(f"mcrdl/nccl/{tag}", self._store)  # type: ignore[attr-defined]
        pg = self._PG(store, rank, size, opts)
        pg.eager_connect_single_device(self._cuda_device)
        return _NCCLGroup(pg, rank, size, self.device.new_stream())

    # -- groups --------------------------------------------------------------------------

    def world(self) -> _NCCLGroup:
        return self._world

    def create_group(self, parent: _NCCLGroup, members: Sequence[int], tag: str) -> _NCCLGroup:
        return self._make(tag, list(members).index(parent.rank), len(members))

    def free_group(self, group: _NCCLGroup) -> None:
        group.pg = None

    def stream(self, group: _NCCLGroup) -> Any:
        return group.stream

    def abandon(self, group: _NCCLGroup) -> None:
        """Abort the group's NCCL communicator: its kernels that wait for peers that will
        not come end, and its stream goes on (the results are undefined; the engine has
        failed those operations already)."""
        if group.pg is not None:
            try:
                group.pg.abort()
            except Exception:  # noqa: BLE001 - aborting is best effort on a broken group
                pass

    def close(self) -> None:
        self._world.pg = None
        self._store = None

    # -- operations ----------------------------------------------------------------------

    def _on_stream(self, group: _NCCLGroup, call: Any, *args: Any) -> Request:
        """``call(*args)`` with the group's stream current, and that stream made to wait for
        its end (see the module docstring)."""
        return self.device.run_on(group.stream, self._waited, call, args)

    @staticmethod
    def _waited(call: Any, args: tuple[Any, ...]) -> Request:
        work = call(*args)
        work.wait()  # (the current stream waits for the collective's end; the host does not)
        return work

    def start_send(self, group: _NCCLGroup, buf: Buffer, dst: int, tag: int) -> Request:
        raise BackendError("nccl: point-to-point runs on a host backend (see mcrdl.backends.nccl)")

    def start_recv(self, group: _NCCLGroup, buf: Buffer, src: int, tag: int) -> Request:
        raise BackendError("nccl: point-to-point runs on a host backend (see mcrdl.backends.nccl)")

    def start_broadcast(self, group: _NCCLGroup, buf: Buffer, root: int) -> Request:
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        return self._on_stream(group, group.pg.broadcast, [buf.torch()], opts)

    def start_reduce(self, group: _NCCLGroup, buf: Buffer, root: int, op: ReduceOp) -> Request:
        opts = self._dist.ReduceOptions()
        opts.reduceOp = self._red[op]  # type: ignore[assignment]
        opts.rootRank = root
        return self._on_stream(group, group.pg.reduce, [buf.torch()], opts)

    def start_allreduce(self, group: _NCCLGroup, buf: Buffer, op: ReduceOp) -> Request:
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._red[op]  # type: ignore[assignment]
        return self._on_stream(group, group.pg.allreduce, [buf.torch()], opts)

    def start_gather(
        self, group: _NCCLGroup, buf: Buffer, out: Buffer | None, root: int
    ) -> Request:
        opts = self._dist.GatherOptions()
        opts.rootRank = root
        outputs = [list(out.torch().chunk(group.size))] if out is not None else []
        return self._on_stream(group, group.pg.gather, outputs, [buf.torch()], opts)

    def start_allgather(self, group: _NCCLGroup, buf: Buffer, out: Buffer) -> Request:
        return self._on_stream(group, group.pg._allgather_base, out.torch(), buf.torch())

    def start_scatter(
        self, group: _NCCLGroup, buf: Buffer | None, out: Buffer, root: int
    ) -> Request:
        opts = self._dist.ScatterOptions()
        opts.rootRank = root
        inputs = [list(buf.torch().chunk(group.size))] if buf is not None else []
        return self._on_stream(group, group.pg.scatter, [out.torch()], inputs, opts)

    def start_reduce_scatter(
        self, group: _NCCLGroup, buf: Buffer, out: Buffer, op: ReduceOp
    ) -> Request:
        opts = self._dist.ReduceScatterOptions()
        opts.reduceOp = self._red[op]  # type: ignore[assignment]
        return self._on_stream(group, group.pg._reduce_scatter_base, out.torch(), buf.torch(),
                               opts)

    def start_alltoall(self, group: _NCCLGroup, buf: Buffer, out: Buffer) -> Request:
        return self._on_stream(group, group.pg.alltoall_base, out.torch(), buf.torch(), [], [])

    def start_alltoallv(
        self,
        group: _NCCLGroup,
        buf: Buffer,
        send_counts: Sequence[int],
        out: Buffer,
        recv_counts: Sequence[int],
    ) -> Request:
        return self._on_stream(group, group.pg.alltoall_base, out.torch(), buf.torch(),
                               list(recv_counts), list(send_counts))

    def start_barrier(self, group: _NCCLGroup) -> Request:
        one = self._torch.ones(1, device=self._cuda_device)
        return self._on_stream(group, group.pg.allreduce, [one], self._dist.AllreduceOptions())

    # -- completion ----------------------------------------------------------------------

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        out: list[tuple[int, BaseException | None]] = []
        for i, work in enumerate(requests):
            try:
                done = work.is_completed()
            except Exception as exc:  # noqa: BLE001 - the Work's failure, reported as ours
                out.append((i, BackendError(f"nccl: {exc}")))
                continue
            if done:
                out.append((i, None))
        return out
