"""The cupy-nccl backend: NCCL through ``cupy.cuda.nccl``, on a stream of mcrdl's per communicator.

The same library as the ``nccl`` backend, without torch.distributed in between: each call is
one NCCL call (or one NCCL group of sends and receives) queued on the communicator's stream,
and the request is an event recorded right after it. Brought up only when asked for
(``init(backends=["mpi", "gloo", "cupy-nccl"])``), on the GPU current when ``init()`` runs;
it needs cupy (``pip install cupy-cuda12x``) and torch with CUDA, whose streams, events and
tensors it uses (mcrdl's device buffers are torch CUDA tensors).

How it orders work (``Capabilities.stream_ordered``): every call gets the stream of its group
(``stream``), which the engine made wait for the caller's stream and for the operations this
one depends on; the event recorded after it marks its end. Nothing here blocks the host but
making a communicator (``ncclCommInitRank`` waits for every member), which group creation may.

Quirks beyond the contract:
- Communicators are made from a unique id that the first member puts in the runtime's store
  under a key per communicator, and the others read.
- NCCL has no gather, scatter or all-to-all: they are groups of sends and receives
  (``ncclGroupStart``/``ncclGroupEnd``), this rank's own chunk copied on the stream.
- Point-to-point is left to the host backends: NCCL matches sends and receives by order per
  peer, never by tag, where mcrdl matches them by peer and tag.
- A barrier is an allreduce of one element on the device.
- AVG is NCCL's own where cupy exposes it (NCCL 2.10+); otherwise the engine runs SUM and
  divides. Booleans move as bytes; they are not reduced.
- NCCL cannot cancel an operation; a communicator mcrdl gives up on is aborted (``abandon``),
  which ends its kernels on this rank so that its stream does not stay blocked.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core._errors import BackendError
from ..core._types import DType, OpKind, ReduceOp
from ._contract import Backend, Capabilities, Rendezvous, Request

if TYPE_CHECKING:
    from ..core._buffers import Buffer

__all__ = ["CupyNCCLBackend"]

#: mcrdl's dtypes, by the name of cupy.cuda.nccl's constant for them.
_TYPES = {DType.BOOL: "NCCL_UINT8", DType.UINT8: "NCCL_UINT8", DType.INT8: "NCCL_INT8",
          DType.INT32: "NCCL_INT32", DType.UINT32: "NCCL_UINT32", DType.INT64: "NCCL_INT64",
          DType.UINT64: "NCCL_UINT64", DType.FLOAT16: "NCCL_FLOAT16",
          DType.BFLOAT16: "NCCL_BFLOAT16", DType.FLOAT32: "NCCL_FLOAT32",
          DType.FLOAT64: "NCCL_FLOAT64"}
_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD", ReduceOp.MIN: "NCCL_MIN",
        ReduceOp.MAX: "NCCL_MAX", ReduceOp.AVG: "NCCL_AVG"}
_FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})


def _nccl() -> Any:
    from cupy.cuda import nccl

    return nccl


class _CupyGroup:
    __slots__ = ("comm", "rank", "size", "stream", "ptr", "one")

    def __init__(self, comm: Any, rank: int, size: int, stream: Any, one: Any) -> None:
        self.comm = comm
        self.rank = rank
        self.size = size
        self.stream = stream
        self.ptr: int = stream.cuda_stream  # what cupy's calls take
        self.one = one  # the barrier's element

    def __repr__(self) -> str:
        return f"<cupy-nccl group rank={self.rank}/{self.size}>"


class CupyNCCLBackend(Backend):
    """NCCL through cupy (see the module docstring)."""

    name = "cupy-nccl"

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("cupy") is None or importlib.util.find_spec("torch") is None:
            return False
        try:
            import torch

            return bool(_nccl().available and torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - is_available never raises
            return False

    def __init__(self, bootstrap: Rendezvous) -> None:
        import torch

        from ._cuda import CudaDevice

        self._torch = torch
        self._nccl = nccl = _nccl()
        self._store = bootstrap.store()
        self.device = CudaDevice(torch.cuda.current_device())
        # cupy declares every constant whatever NCCL it loads: bfloat16 and AVG need 2.10.
        recent = nccl.get_version() >= 21000
        self._types = {dt: getattr(nccl, const) for dt, const in _TYPES.items()
                       if hasattr(nccl, const) and (recent or dt is not DType.BFLOAT16)}
        self._ops = {op: getattr(nccl, const) for op, const in _OPS.items()
                     if hasattr(nccl, const) and (recent or op is not ReduceOp.AVG)}
        moved = frozenset(self._types)
        numeric = moved - {DType.BOOL}
        reductions: dict[ReduceOp, frozenset[DType]] = {
            op: numeric for op in self._ops if op is not ReduceOp.AVG}
        if ReduceOp.AVG in self._ops:
            reductions[ReduceOp.AVG] = numeric & _FLOATS
        self.capabilities = Capabilities(
            ops=frozenset(OpKind) - {OpKind.SEND, OpKind.RECV},
            dtypes=moved,
            reductions=reductions,
            devices=frozenset({"cuda"}),
            stream_ordered=True,
            in_order=True,
        )
        self._world = self._make(f"world/{bootstrap.size}", bootstrap.rank, bootstrap.size)

    def _make(self, tag: str, rank: int, size: int) -> _CupyGroup:
        """A communicator of ``size`` members, made by all of them (blocks until they are)."""
        key = f"mcrdl/cupy-nccl/{tag}/id"
        if rank == 0:
            uid = self._nccl.get_unique_id()
            self._store.set(key, bytes(b & 0xFF for b in uid))
        else:
            uid = tuple(b - 256 if b > 127 else b for b in self._store.get(key))
        with self._torch.cuda.device(self.device.index):
            comm = self._nccl.NcclCommunicator(size, uid, rank)
            one = self._torch.ones(1, device=f"cuda:{self.device.index}")
        return _CupyGroup(comm, rank, size, self.device.new_stream(), one)

    # -- groups --------------------------------------------------------------------------

    def world(self) -> _CupyGroup:
        return self._world

    def create_group(self, parent: _CupyGroup, members: Sequence[int], tag: str) -> _CupyGroup:
        return self._make(tag, list(members).index(parent.rank), len(members))

    def free_group(self, group: _CupyGroup) -> None:
        group.comm = None  # (destroyed when collected: ncclCommDestroy)

    def stream(self, group: _CupyGroup) -> Any:
        return group.stream

    def abandon(self, group: _CupyGroup) -> None:
        """Abort the group's communicator: its kernels that wait for peers that will not
        come end, and its stream goes on (the engine has failed those operations already)."""
        if group.comm is not None:
            try:
                group.comm.abort()
            except Exception:  # noqa: BLE001 - aborting is best effort on a broken group
                pass

    def close(self) -> None:
        self._world.comm = None
        self._store = None

    # -- operations ----------------------------------------------------------------------

    def _end(self, group: _CupyGroup) -> Request:
        """The request of what was just queued on ``group``'s stream: an event after it."""
        return self.device.record(group.stream)

    def _count(self, buf: Buffer) -> int:
        return buf.nbytes // int(buf.obj.element_size())

    def start_send(self, group: _CupyGroup, buf: Buffer, dst: int, tag: int) -> Request:
        raise BackendError("cupy-nccl: point-to-point runs on a host backend "
                           "(see mcrdl.backends.cupy_nccl)")

    def start_recv(self, group: _CupyGroup, buf: Buffer, src: int, tag: int) -> Request:
        raise BackendError("cupy-nccl: point-to-point runs on a host backend "
                           "(see mcrdl.backends.cupy_nccl)")

    def start_broadcast(self, group: _CupyGroup, buf: Buffer, root: int) -> Request:
        group.comm.broadcast(buf.addr, buf.addr, self._count(buf), self._types[buf.dtype],
                             root, group.ptr)
        return self._end(group)

    def start_reduce(self, group: _CupyGroup, buf: Buffer, root: int, op: ReduceOp) -> Request:
        group.comm.reduce(buf.addr, buf.addr, self._count(buf), self._types[buf.dtype],
                          self._ops[op], root, group.ptr)
        return self._end(group)

    def start_allreduce(self, group: _CupyGroup, buf: Buffer, op: ReduceOp) -> Request:
        group.comm.allReduce(buf.addr, buf.addr, self._count(buf), self._types[buf.dtype],
                             self._ops[op], group.ptr)
        return self._end(group)

    def start_allgather(self, group: _CupyGroup, buf: Buffer, out: Buffer) -> Request:
        group.comm.allGather(buf.addr, out.addr, self._count(buf), self._types[buf.dtype],
                             group.ptr)
        return self._end(group)

    def start_reduce_scatter(
        self, group: _CupyGroup, buf: Buffer, out: Buffer, op: ReduceOp
    ) -> Request:
        group.comm.reduceScatter(buf.addr, out.addr, self._count(out),
                                 self._types[buf.dtype], self._ops[op], group.ptr)
        return self._end(group)

    def _exchange(self, group: _CupyGroup, dtype: DType,
                  sends: Sequence[Any | None], recvs: Sequence[Any | None]) -> Request:
        """One NCCL group: ``sends[p]`` to peer p and ``recvs[p]`` from it (torch views, or
        None for nothing), this rank's own chunk copied on the stream."""
        nccl = self._nccl
        comm, ptr, kind = group.comm, group.ptr, self._types[dtype]
        me = group.rank
        mine, into = sends[me], recvs[me]
        if mine is not None and into is not None and mine.numel():
            with self._torch.cuda.stream(group.stream):
                into.copy_(mine)
        nccl.groupStart()
        try:
            for peer in range(group.size):
                if peer == me:
                    continue
                send, recv = sends[peer], recvs[peer]
                if send is not None and send.numel():
                    comm.send(send.data_ptr(), send.numel(), kind, peer, ptr)
                if recv is not None and recv.numel():
                    comm.recv(recv.data_ptr(), recv.numel(), kind, peer, ptr)
        finally:
            nccl.groupEnd()
        return self._end(group)

    def _flat(self, buf: Buffer) -> Any:
        """``buf`` as a 1-d tensor (booleans as bytes, as NCCL moves them)."""
        flat = buf.torch().reshape(-1)
        return flat.view(self._torch.uint8) if buf.dtype is DType.BOOL else flat

    def start_gather(
        self, group: _CupyGroup, buf: Buffer, out: Buffer | None, root: int
    ) -> Request:
        n = group.size
        none: list[Any | None] = [None] * n
        sends = list(none)
        sends[root] = self._flat(buf)
        recvs = list(self._flat(out).chunk(n)) if out is not None else none
        return self._exchange(group, buf.dtype, sends, recvs)

    def start_scatter(
        self, group: _CupyGroup, buf: Buffer | None, out: Buffer, root: int
    ) -> Request:
        n = group.size
        none: list[Any | None] = [None] * n
        sends = list(self._flat(buf).chunk(n)) if buf is not None else none
        recvs = list(none)
        recvs[root] = self._flat(out)
        return self._exchange(group, out.dtype, sends, recvs)

    def start_alltoall(self, group: _CupyGroup, buf: Buffer, out: Buffer) -> Request:
        n = group.size
        return self._exchange(group, buf.dtype, list(self._flat(buf).chunk(n)),
                              list(self._flat(out).chunk(n)))

    def start_alltoallv(
        self,
        group: _CupyGroup,
        buf: Buffer,
        send_counts: Sequence[int],
        out: Buffer,
        recv_counts: Sequence[int],
    ) -> Request:
        row = buf.row_elems()
        sends = list(self._flat(buf).split([c * row for c in send_counts]))
        recvs = list(self._flat(out).split([c * row for c in recv_counts]))
        return self._exchange(group, buf.dtype, sends, recvs)

    def start_barrier(self, group: _CupyGroup) -> Request:
        group.comm.allReduce(group.one.data_ptr(), group.one.data_ptr(), 1,
                             self._types[DType.FLOAT32], self._ops[ReduceOp.SUM], group.ptr)
        return self._end(group)

    # -- completion ----------------------------------------------------------------------

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        query = self.device.query
        return [(i, None) for i, event in enumerate(requests) if query(event)]
