"""The mpi backend: mpi4py's nonblocking calls, completed by ``Testsome`` over all in-flight requests.

Quirks beyond the contract:
- MPI is initialized by the runtime's bootstrap at thread level SERIALIZED (MULTIPLE costs
  ~2x per small call with MPICH); the engine's lock serializes every call made here.
- torch tensors travel as ``MPI.buffer.fromaddress`` over their storage with an explicit
  datatype (0.1 µs; their ``.numpy()`` view costs 0.7 µs and a tensor handed to mpi4py
  directly 5-20 µs); numpy arrays travel as themselves. bfloat16 has no MPI datatype: it
  travels as int16 bits, so it moves but does not reduce.
- Every communicator is private (a Dup or Create_group), so user traffic on COMM_WORLD can
  never match ours.
- Reductions on bool use the logical ops (SUM and MAX are LOR, PROD and MIN are LAND).
"""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import BackendError, BackendUnavailableError
from .._types import DType, OpKind, ReduceOp
from ._contract import Backend, Bootstrap, Capabilities, Request

if TYPE_CHECKING:
    from .._buffers import Buffer

__all__ = ["MPIBackend"]

_INTS = frozenset({DType.UINT8, DType.INT8, DType.INT16, DType.INT32, DType.INT64,
                   DType.UINT16, DType.UINT32, DType.UINT64})
_REALS = frozenset({DType.FLOAT32, DType.FLOAT64})
_COMPLEX = frozenset({DType.COMPLEX64, DType.COMPLEX128})


class _MPIGroup:
    __slots__ = ("comm", "rank", "size")

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def __repr__(self) -> str:
        return f"<mpi group rank={self.rank}/{self.size}>"


def _float16_reduces(MPI: Any) -> bool:
    """Whether this MPI library reduces float16 (MPICH's MPIX_C_FLOAT16) correctly."""
    import numpy as np

    try:
        a = np.array([1.5, -2.0, 65504.0], dtype=np.float16)
        b = np.empty_like(a)
        MPI.COMM_SELF.Allreduce(a, b, op=MPI.SUM)
        return bool((a == b).all())
    except Exception:  # noqa: BLE001 - any failure means "no"
        return False


class MPIBackend(Backend):
    """MPI through mpi4py (see the module docstring for its quirks)."""

    name = "mpi"

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("mpi4py") is not None

    def __init__(self, bootstrap: Bootstrap) -> None:
        if bootstrap.launcher not in ("mpi", "single"):
            raise BackendUnavailableError(
                f"the mpi backend needs an MPI launcher (mpiexec, srun) or a single process; "
                f"this process was started by {bootstrap.launcher}"
            )
        from .._bootstrap import import_mpi

        self._MPI = MPI = import_mpi()
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise BackendUnavailableError(
                "MPI was initialized below THREAD_SERIALIZED; set mpi4py.rc.thread_level = "
                "'serialized' (or let mcrdl import mpi4py first)"
            )
        self._world = _MPIGroup(MPI.COMM_WORLD.Dup())
        self._IN_PLACE = MPI.IN_PLACE
        self._fromaddress = MPI.buffer.fromaddress
        self._types = {
            DType.BOOL: MPI.C_BOOL, DType.UINT8: MPI.UINT8_T, DType.INT8: MPI.INT8_T,
            DType.INT16: MPI.INT16_T, DType.INT32: MPI.INT32_T, DType.INT64: MPI.INT64_T,
            DType.UINT16: MPI.UINT16_T, DType.UINT32: MPI.UINT32_T, DType.UINT64: MPI.UINT64_T,
            DType.FLOAT16: MPI.FLOAT16_T, DType.BFLOAT16: MPI.INT16_T, DType.FLOAT32: MPI.FLOAT,
            DType.FLOAT64: MPI.DOUBLE, DType.COMPLEX64: MPI.C_FLOAT_COMPLEX,
            DType.COMPLEX128: MPI.C_DOUBLE_COMPLEX,
        }
        self._testsome = MPI.Request.Testsome
        self._statuses: list[Any] = []
        floats = _REALS | ({DType.FLOAT16} if _float16_reduces(MPI) else frozenset())
        ordered = _INTS | floats
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD,
                     ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}
        self._bool_ops = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR,
                          ReduceOp.PROD: MPI.LAND, ReduceOp.MIN: MPI.LAND}
        self.capabilities = Capabilities(
            ops=frozenset(OpKind),
            dtypes=frozenset(DType),
            reductions={
                ReduceOp.SUM: ordered | _COMPLEX | {DType.BOOL},
                ReduceOp.PROD: ordered | _COMPLEX | {DType.BOOL},
                ReduceOp.MIN: ordered | {DType.BOOL},
                ReduceOp.MAX: ordered | {DType.BOOL},
            },
            cancel=False,
            self_progressing=False,
        )

    # -- groups --------------------------------------------------------------------------

    def world(self) -> _MPIGroup:
        return self._world

    def create_group(self, parent: _MPIGroup, members: Sequence[int], tag: str) -> _MPIGroup:
        group = parent.comm.Get_group().Incl(list(members))
        # Create_group is collective over the members only; its tag keeps concurrent
        # creations on one parent apart.
        comm = parent.comm.Create_group(group, tag=zlib.crc32(tag.encode()) & 0x7FFF)
        group.Free()
        return _MPIGroup(comm)

    def free_group(self, group: _MPIGroup) -> None:
        if group.comm is not None:
            group.comm.Free()
            group.comm = None

    def close(self) -> None:
        self.free_group(self._world)

    # -- operations ----------------------------------------------------------------------

    def _op(self, op: ReduceOp, buf: Buffer) -> Any:
        return (self._bool_ops if buf.dtype is DType.BOOL else self._ops)[op]

    def _msg(self, buf: Buffer) -> list[Any]:
        """mpi4py's message spec for ``buf``: its memory and its datatype."""
        obj, dtype, nbytes, start, is_torch, _ = buf
        if is_torch:
            return [self._fromaddress(start, nbytes), self._types[dtype]]
        return [obj, self._types[dtype]]

    def start_send(self, group: _MPIGroup, buf: Buffer, dst: int, tag: int) -> Request:
        return group.comm.Isend(self._msg(buf), dst, tag)

    def start_recv(self, group: _MPIGroup, buf: Buffer, src: int, tag: int) -> Request:
        return group.comm.Irecv(self._msg(buf), src, tag)

    def start_broadcast(self, group: _MPIGroup, buf: Buffer, root: int) -> Request:
        return group.comm.Ibcast(self._msg(buf), root)

    def start_reduce(self, group: _MPIGroup, buf: Buffer, root: int, op: ReduceOp) -> Request:
        if group.rank == root:
            return group.comm.Ireduce(self._IN_PLACE, self._msg(buf), self._op(op, buf), root)
        return group.comm.Ireduce(self._msg(buf), None, self._op(op, buf), root)

    def start_allreduce(self, group: _MPIGroup, buf: Buffer, op: ReduceOp) -> Request:
        obj, dtype, nbytes, start, is_torch, _ = buf
        msg = [self._fromaddress(start, nbytes) if is_torch else obj, self._types[dtype]]
        ops = self._bool_ops if dtype is DType.BOOL else self._ops
        return group.comm.Iallreduce(self._IN_PLACE, msg, ops[op])

    def start_gather(self, group: _MPIGroup, buf: Buffer, out: Buffer | None, root: int) -> Request:
        recv = self._msg(out) if out is not None else None
        return group.comm.Igather(self._msg(buf), recv, root)

    def start_allgather(self, group: _MPIGroup, buf: Buffer, out: Buffer) -> Request:
        return group.comm.Iallgather(self._msg(buf), self._msg(out))

    def start_scatter(self, group: _MPIGroup, buf: Buffer | None, out: Buffer, root: int) -> Request:
        send = self._msg(buf) if buf is not None else None
        return group.comm.Iscatter(send, self._msg(out), root)

    def start_reduce_scatter(
        self, group: _MPIGroup, buf: Buffer, out: Buffer, op: ReduceOp
    ) -> Request:
        return group.comm.Ireduce_scatter_block(self._msg(buf), self._msg(out), self._op(op, buf))

    def start_alltoall(self, group: _MPIGroup, buf: Buffer, out: Buffer) -> Request:
        return group.comm.Ialltoall(self._msg(buf), self._msg(out))

    def start_alltoallv(
        self,
        group: _MPIGroup,
        buf: Buffer,
        send_counts: Sequence[int],
        out: Buffer,
        recv_counts: Sequence[int],
    ) -> Request:
        row = buf.row_elems()
        scounts = [c * row for c in send_counts]
        rcounts = [c * row for c in recv_counts]
        (smem, stype), (rmem, rtype) = self._msg(buf), self._msg(out)
        return group.comm.Ialltoallv([smem, (scounts, _displs(scounts)), stype],
                                     [rmem, (rcounts, _displs(rcounts)), rtype])

    def start_barrier(self, group: _MPIGroup) -> Request:
        return group.comm.Ibarrier()

    # -- completion ----------------------------------------------------------------------

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        if len(requests) == 1:
            try:
                return [(0, None)] if requests[0].Test() else []
            except self._MPI.Exception as exc:
                return [(0, BackendError(f"MPI: {exc.Get_error_string()}"))]
        statuses = self._statuses
        if len(statuses) < len(requests):
            statuses.extend(self._MPI.Status() for _ in range(len(requests) - len(statuses)))
        try:
            done = self._testsome(requests, statuses)
        except self._MPI.Exception:
            return self._failed_some(requests, statuses)
        return [(i, None) for i in done] if done else []

    def _failed_some(
        self, requests: list[Request], statuses: list[Any]
    ) -> list[tuple[int, BaseException | None]]:
        # Testsome raised ERR_IN_STATUS: it has completed (and nulled) every request it
        # reports on, the successful ones too; each one's own error is in its status.
        MPI = self._MPI
        out: list[tuple[int, BaseException | None]] = []
        for i, req in enumerate(requests):
            if req:
                continue
            code = statuses[i].Get_error()
            if code == MPI.SUCCESS:
                out.append((i, None))
            else:
                out.append((i, BackendError(f"MPI: {MPI.Get_error_string(code)}")))
        return out


def _displs(counts: Sequence[int]) -> list[int]:
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return displs
