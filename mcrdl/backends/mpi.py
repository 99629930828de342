"""The mpi backend: mpi4py's nonblocking calls, completed by ``Testsome`` over all in-flight requests.

Quirks beyond the contract:
- MPI is initialized by the runtime's bootstrap at thread level SERIALIZED (MULTIPLE makes
  every small call markedly dearer with MPICH: docs/performance.md, "Symptom -> setting");
  the engine's lock serializes every call made here.
- torch tensors travel as ``MPI.buffer.fromaddress`` over their storage with an explicit
  datatype, the cheapest way: their ``.numpy()`` view costs several times as much per call,
  and a tensor handed to mpi4py directly (through its buffer protocol) many times more
  (docs/performance-log.md, "Fast paths kept and dropped"); numpy arrays travel as
  themselves. bfloat16 has no MPI datatype: it travels as int16 bits, and bfloat16 and
  float16 reduce through user-defined ops that reduce with torch (see ``_half_ops``).
- Every communicator is private (a Dup or Create_group), so user traffic on COMM_WORLD can
  never match ours.
- Reductions on bool use the logical ops (SUM and MAX are LOR, PROD and MIN are LAND).
- Which memory this MPI reaches is read, not assumed: ``memory_kinds`` is the library's
  ``mpi_memory_alloc_kinds`` (MPI 4.1; MPICH 5.0.2's pip wheel says ``mpi,system``),
  ``cuda_support`` what its ``MPIX_Query_cuda_support()`` answers (MPICH, Open MPI; the
  wheel's: 0), and ``cuda_aware`` whether either names CUDA. A CUDA-aware build gets device
  buffers as they are (``capabilities.direct``: a CUDA tensor goes by its device address, as
  a host tensor goes by its own), except for the half-precision reductions, whose host
  callback (``_half_ops``) cannot read device memory (``host_only``); the runtime stages those,
  and every operation on device buffers of an MPI that is not CUDA-aware or does not say,
  through pinned host copies (``backends._staging``; docs/gpu.md).
- Under Open MPI with its fault tolerance on (``mpiexec --with-ft ulfm``), it shrinks a
  group to its live members (``regroup``): ``backends._ulfm``.
"""

from __future__ import annotations

import importlib.util
import zlib
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core._errors import BackendError, BackendUnavailableError, DesyncError
from ..core._forever import forever
from ..core._types import REDUCING, DType, OpKind, ReduceOp
from . import _ulfm
from ._contract import Backend, Capabilities, Rendezvous, Request

if TYPE_CHECKING:
    from ..core._buffers import Buffer

__all__ = ["COPY_BY_TYPES", "MPIBackend", "SEGMENT_BYTES", "SEGMENT_FROM", "SEGMENT_WINDOW"]

#: Allreduces of at least this many bytes are cut into segments (see _Segmented).
SEGMENT_FROM = 8 << 20
#: Bytes per segment, and segments in flight at once per communicator.
SEGMENT_BYTES = 2 << 20
SEGMENT_WINDOW = 2
#: Host copies from which `MPIBackend.copy_host` makes them one MPI call.
COPY_BY_TYPES = 8

_INTS = frozenset({DType.UINT8, DType.INT8, DType.INT16, DType.INT32, DType.INT64,
                   DType.UINT16, DType.UINT32, DType.UINT64})
_REALS = frozenset({DType.FLOAT32, DType.FLOAT64})
_COMPLEX = frozenset({DType.COMPLEX64, DType.COMPLEX128})
_HALVES = frozenset({DType.FLOAT16, DType.BFLOAT16})
#: Communicators of broken groups, never freed (``MPIBackend.abandon``), not even by the
#: interpreter's teardown, which runs before MPI_Finalize (`forever`).
_KEPT: list[tuple[Any, Any]] = forever([])


def _memory_kinds(MPI: Any) -> tuple[str, ...]:
    """The library's ``mpi_memory_alloc_kinds`` (MPI 4.1), e.g. ``("mpi", "system")`` or
    ``("system", "cuda:device")``; empty where it does not report them."""
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception:  # noqa: BLE001 - an MPI before 4.1: it does not say
        return ()
    return tuple(k.strip() for k in (value or "").split(",") if k.strip())


def _cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the MPI library this process loaded (MPICH and Open
    MPI export it; it says whether the library was built with CUDA support and has it
    enabled); None where the library cannot be found among the process's mappings (not
    Linux) or lacks the function."""
    import ctypes
    import re

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if re.search(r"/libmpi\.so(\.\d+)*$", p)):
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:  # (a mapping of a file gone since, or not a library ctypes loads)
            continue
        if query is not None:
            query.restype, query.argtypes = ctypes.c_int, []
            return bool(query())
    return None


class _MPIGroup:
    __slots__ = ("comm", "rank", "size", "seg_comm", "segq")

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # Segmented reductions run on a communicator of their own, their segments issued in
        # the order the operations were started (segq), so that segments of different
        # operations can never interleave differently on different ranks.
        self.seg_comm = comm.Dup()
        self.segq: deque[_Segmented] = deque()

    def __repr__(self) -> str:
        return f"<mpi group rank={self.rank}/{self.size}>"


class _AnySource:
    """A receive from any source: a matched probe (``Improbe``) of its tag until a message is
    there, then the receive of that very message (``Message.Irecv``), so that its source is
    known the moment the message is taken and no other receive can take it meanwhile."""

    __slots__ = ("comm", "mem", "tag", "anyone", "nbytes", "source", "req")

    def __init__(self, comm: Any, mem: Any, tag: int, anyone: int, nbytes: int) -> None:
        self.comm, self.mem, self.tag, self.anyone = comm, mem, tag, anyone  # (MPI_ANY_SOURCE)
        self.nbytes = nbytes
        self.source = -1
        self.req: Any = None

    def Test(self, status: Any) -> bool:  # noqa: N802 - quacks like an MPI.Request
        """Probe, then receive; True once the message is in ``mem`` (``status``: the
        receive's, which the backend reads)."""
        if self.req is None:
            message = self.comm.Improbe(self.anyone, self.tag, status)
            if message is None:
                return False
            self.source = status.Get_source()
            self.req = message.Irecv(self.mem)
        return self.req.Test(status)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return (f"<mpi receive from any source, tag {self.tag}: "
                f"{'matched from rank %d' % self.source if self.req else 'no message yet'}>")


class _Segmented:
    """A large allreduce cut into segments, a window of them in flight at a time.

    MPICH's nonblocking allreduce of a large message takes much longer than its blocking
    one; segments of ``SEGMENT_BYTES``, ``SEGMENT_WINDOW`` at a time, finish sooner than
    either (docs/performance-log.md, "The overhead table before the five-op benchmark (Intel
    Xeon host)").

    Invariants: ``pieces[next:]`` are not issued yet; ``active`` holds the issued, unfinished
    segment requests; segments are issued in order, and only by ``MPIBackend._advance``.
    """

    __slots__ = ("backend", "group", "pieces", "next", "active", "op", "error")

    def __init__(self, backend: MPIBackend, group: _MPIGroup, pieces: list[Any], op: Any) -> None:
        self.backend = backend
        self.group = group
        self.pieces = pieces
        self.next = 0
        self.active: list[Any] = []
        self.op = op
        self.error: BaseException | None = None

    def Test(self, status: Any = None) -> bool:  # noqa: N802 - quacks like an MPI.Request
        """Advance this operation's segments; True once all have finished."""
        return self.backend._segment_test(self)

    def __repr__(self) -> str:
        return (f"<mpi segmented allreduce {self.next}/{len(self.pieces)} issued, "
                f"{len(self.active)} in flight>")


_HALF_OPS: dict[Any, Any] = {}


def _half_ops(MPI: Any) -> dict[Any, Any]:
    """The 16-bit float ops, made once per process (mpi4py has room for 16 user-defined
    reduction ops in all, and a runtime may be brought up again after finalize)."""
    if not _HALF_OPS:
        _HALF_OPS.update(_make_half_ops(MPI))
    return _HALF_OPS


def _make_half_ops(MPI: Any) -> dict[Any, Any]:
    """MPI ops reducing 16-bit floats (bfloat16, float16) with torch, by bit pattern.

    MPI has no bfloat16 type, and MPICH's float16 reduction runs far slower than its float32
    one; a user-defined op over the 2-byte words, reducing with torch in the dtype the
    operation carries, is many times faster than MPICH's own. The callback must never raise:
    an exception inside it aborts the whole MPI job. So it only reinterprets the two buffers
    (empty ones are skipped) and reduces in place.
    """
    import torch

    def make(reduce_into: Any, dtype: Any) -> Any:
        def fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            if len(memoryview(inbuf)) == 0:
                return
            a = torch.frombuffer(inbuf, dtype=dtype)
            b = torch.frombuffer(inoutbuf, dtype=dtype)
            reduce_into(b, a)

        return MPI.Op.Create(fn, commute=True)

    ops: dict[Any, Any] = {}
    for dt, tdt in ((DType.BFLOAT16, torch.bfloat16), (DType.FLOAT16, torch.float16)):
        ops[(dt, ReduceOp.SUM)] = make(lambda b, a: b.add_(a), tdt)
        ops[(dt, ReduceOp.PROD)] = make(lambda b, a: b.mul_(a), tdt)
        ops[(dt, ReduceOp.MIN)] = make(lambda b, a: torch.minimum(b, a, out=b), tdt)
        ops[(dt, ReduceOp.MAX)] = make(lambda b, a: torch.maximum(b, a, out=b), tdt)
    return ops


class MPIBackend(Backend):
    """MPI through mpi4py (see the module docstring for its quirks)."""

    name = "mpi"

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("mpi4py") is not None

    def __init__(self, bootstrap: Rendezvous) -> None:
        if bootstrap.launcher not in ("mpi", "single"):
            raise BackendUnavailableError(
                f"the mpi backend needs an MPI launcher (mpiexec, srun) or a single process; "
                f"this process was started by {bootstrap.launcher}"
            )
        from ..bootstrap._launch import import_mpi

        self._MPI = MPI = import_mpi()
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise BackendUnavailableError(
                "MPI was initialized below THREAD_SERIALIZED; set mpi4py.rc.thread_level = "
                "'serialized' (or let mcrdl import mpi4py first)"
            )
        self._world = _MPIGroup(MPI.COMM_WORLD.Dup())
        #: Whether MPI is fault tolerant here (ULFM): it can go on once members are gone.
        self._ft = _ulfm.enabled(MPI)
        #: This process alone: `copy_host`'s sendrecv to itself.
        self._self = MPI.COMM_SELF.Dup()
        #: The kinds of memory this MPI library says it reaches (empty: it does not say).
        self.memory_kinds = _memory_kinds(MPI)
        #: What ``MPIX_Query_cuda_support()`` answers (None: the library has no such query).
        self.cuda_support = _cuda_support()
        #: Whether it reaches CUDA device memory (a CUDA-aware build): its memory kinds, or
        #: its MPIX query, say so.
        self.cuda_aware = (any(kind.partition(":")[0] == "cuda" for kind in self.memory_kinds)
                           or self.cuda_support is True)
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
        self._status = MPI.Status()
        #: A receive's request, which carries the bytes it expects: MPI completes a receive
        #: of a shorter message without an error, leaving the rest of the buffer as it was,
        #: and its status says how much came (`_received`). (A subclass of MPI's own, so that
        #: Testsome takes it; made here, since mpi4py is imported only now.)
        self._Recv: Any = type("_Recv", (MPI.Request,), {"__slots__": ("nbytes",)})
        self._receives = (self._Recv, _AnySource)  # the requests that are receives
        ordered = _INTS | _REALS | {DType.FLOAT16, DType.BFLOAT16}
        ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD,
               ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND,
               ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}
        bool_ops = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR,
                    ReduceOp.PROD: MPI.LAND, ReduceOp.MIN: MPI.LAND,
                    ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR,
                    ReduceOp.BXOR: MPI.LXOR}
        #: The MPI op reducing each (dtype, ReduceOp) that MPI reduces: its own ops for the
        #: dtypes MPI's own ops reduce, logical ones for bool, user-defined ones for the
        #: halves (`_half_ops`).
        self._mops: dict[tuple[DType, ReduceOp], Any] = {
            (dt, op): mop for dt in _INTS | _REALS | _COMPLEX for op, mop in ops.items()}
        self._mops.update(((DType.BOOL, op), mop) for op, mop in bool_ops.items())
        self._mops.update(_half_ops(MPI))
        self.capabilities = Capabilities(
            ops=frozenset(OpKind),
            dtypes=frozenset(DType),
            reductions={
                ReduceOp.SUM: ordered | _COMPLEX | {DType.BOOL},
                ReduceOp.PROD: ordered | _COMPLEX | {DType.BOOL},
                ReduceOp.MIN: ordered | {DType.BOOL},
                ReduceOp.MAX: ordered | {DType.BOOL},
                ReduceOp.BAND: _INTS | {DType.BOOL},
                ReduceOp.BOR: _INTS | {DType.BOOL},
                ReduceOp.BXOR: _INTS | {DType.BOOL},
            },
            direct=frozenset({"cuda"}) if self.cuda_aware else frozenset(),
            cancel=False,
            any_source=True,
            self_progressing=False,
            # One collective per communicator in flight: MPICH moves data only inside the
            # caller's tests, and tests of many nonblocking collectives at once advance them
            # all slower than one after another: a burst of allreduces issued together, then
            # waited for, takes longer per operation than the same ones one at a time, small
            # or large (docs/performance-log.md, "One collective in flight per MPI
            # communicator").
            issue_window=1,
            regroups_after_loss=self._ft,
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

    def regroup(self, parent: _MPIGroup, members: Sequence[int], tag: str,
                store: Any) -> _MPIGroup:
        """Under ULFM, ``parent`` shrunk to its live members (``Shrink``: collective over
        them alone), which must be ``members``, the agreed survivors.

        Raises:
            BackendError: a member died after the agreement (MPI's survivors are fewer), or
                MPI could not shrink.
            BackendUnavailableError: MPI is not fault tolerant here.
        """
        if not self._ft:
            super().regroup(parent, members, tag, store)  # (raises)
        MPI = self._MPI
        try:
            comm = parent.comm.Shrink()
        except MPI.Exception as exc:
            raise self._error(exc) from None
        got = _ulfm.ranks_in(MPI, comm, parent.comm)
        if got != list(members):
            _KEPT.append((comm, None))
            raise BackendError(f"MPI's live members are ranks {got} of the parent, not the "
                               f"agreed {list(members)}: a member died since the agreement")
        return _MPIGroup(comm)

    def abandon(self, group: _MPIGroup) -> None:
        """Never free ``group``'s communicators: MPICH releases a freed communicator's
        context id, and a communicator made later may get it again; a message that an
        abandoned operation of a peer sent on the old one (a zombie collective whose match
        never came) would then be matched by an operation of the new one, and deliver the
        wrong data."""
        if group.comm is not None:
            _KEPT.append((group.comm, group.seg_comm))
            group.comm = group.seg_comm = None

    def free_group(self, group: _MPIGroup) -> None:
        """Free ``group``'s communicators. MPI refuses to free one that holds messages no
        receive matched (MPICH: "being freed has 4 unmatched message(s)"): it is then kept
        until MPI_Finalize, as an abandoned one is, and the refusal is a BackendError that
        says so (never a second attempt at exit on a handle MPI already invalidated)."""
        if group.comm is None:
            return
        comm, seg_comm = group.comm, group.seg_comm
        group.comm = group.seg_comm = None
        try:
            comm.Free()
        except self._MPI.Exception as exc:
            _KEPT.append((comm, seg_comm))
            text = exc.Get_error_string().strip().splitlines()[-1]
            raise BackendError(
                f"MPI cannot free it ({text.split(': ', 1)[-1]}): messages sent to this rank "
                f"on it were never received (a send without its receive); it is kept until "
                f"MPI_Finalize") from None
        seg_comm.Free()

    def close(self) -> None:
        self.free_group(self._world)
        self._self.Free()

    def copy_host(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """From ``COPY_BY_TYPES`` copies on, all in one call: two indexed datatypes, one over
        the sources and one over the destinations (addresses from ``MPI_BOTTOM``), and a
        sendrecv to this process, which MPICH runs as one copy loop in C. A ``memmove``
        through ctypes costs a Python call per copy, whatever its length, so many small
        copies go faster in one call; at ``COPY_BY_TYPES`` copies the two ways cost about the
        same (docs/performance-log.md, "Fusion's copies in one MPI call")."""
        if len(copies) < COPY_BY_TYPES:
            super().copy_host(copies)
            return
        MPI = self._MPI
        destinations, sources, lengths = zip(*copies)
        types = []  # (sources, destinations)
        try:
            for addresses in (sources, destinations):
                types.append(MPI.BYTE.Create_hindexed(lengths, addresses).Commit())
            src, dst = types
            self._self.Sendrecv([MPI.BOTTOM, 1, src], 0, 0, [MPI.BOTTOM, 1, dst], 0, 0)
        except MPI.Exception as exc:
            raise self._error(exc) from exc
        finally:
            for datatype in types:
                datatype.Free()

    # -- operations ----------------------------------------------------------------------

    def host_only(self, op: OpKind, args: tuple[Any, ...]) -> bool:
        """The half-precision reductions: their callback reduces with torch in host memory
        (a reduction's first argument is the buffer it reduces)."""
        return op in REDUCING and args[0].dtype in _HALVES

    def _msg(self, buf: Buffer) -> list[Any]:
        """mpi4py's message spec for ``buf``: its memory and its datatype. A tensor goes by
        address: handing mpi4py its ``.numpy()`` view, or the tensor itself, costs more per
        call than the rest of the spec (docs/performance-log.md, "Fast paths kept and
        dropped"); an array goes as itself."""
        mem = self._fromaddress(buf.addr, buf.nbytes) if buf.is_torch else buf.obj
        return [mem, self._types[buf.dtype]]

    def start_send(self, group: _MPIGroup, buf: Buffer, dst: int, tag: int) -> Request:
        return group.comm.Isend(self._msg(buf), dst, tag)

    def start_recv(self, group: _MPIGroup, buf: Buffer, src: int, tag: int) -> Request:
        req = self._Recv(group.comm.Irecv(self._msg(buf), src, tag))
        req.nbytes = buf.nbytes
        return req

    def start_recv_any(self, group: _MPIGroup, buf: Buffer, tag: int) -> Request:
        return _AnySource(group.comm, self._msg(buf), tag, self._MPI.ANY_SOURCE, buf.nbytes)

    def source(self, request: Request) -> int:
        return int(request.source)

    def start_broadcast(self, group: _MPIGroup, buf: Buffer, root: int) -> Request:
        return group.comm.Ibcast(self._msg(buf), root)

    def start_reduce(self, group: _MPIGroup, buf: Buffer, root: int, op: ReduceOp) -> Request:
        if group.rank == root:
            return group.comm.Ireduce(self._IN_PLACE, self._msg(buf), self._mops[buf.dtype, op],
                                      root)
        return group.comm.Ireduce(self._msg(buf), None, self._mops[buf.dtype, op], root)

    def start_allreduce(self, group: _MPIGroup, buf: Buffer, op: ReduceOp) -> Request:
        mop = self._mops[buf.dtype, op]
        if buf.nbytes >= SEGMENT_FROM and group.size > 1:
            return self._segmented(group, buf, mop)
        return group.comm.Iallreduce(self._IN_PLACE, self._msg(buf), mop)

    # -- segmented reductions ------------------------------------------------------------

    def _segmented(self, group: _MPIGroup, buf: Buffer, op: Any) -> _Segmented:
        nbytes = buf.nbytes
        mpitype = self._types[buf.dtype]
        itemsize = nbytes // max(1, _numel(buf.obj))
        step = SEGMENT_BYTES // itemsize * itemsize
        if buf.is_torch:
            pieces = [[self._fromaddress(buf.addr + off, min(step, nbytes - off)), mpitype]
                      for off in range(0, nbytes, step)]
        else:
            flat = buf.obj.reshape(-1)
            n = step // itemsize
            pieces = [[flat[i:i + n], mpitype] for i in range(0, flat.size, n)]
        seg = _Segmented(self, group, pieces, op)
        group.segq.append(seg)
        self._advance(group)
        return seg

    def _advance(self, group: _MPIGroup) -> None:
        """Issue queued segments, oldest operation first, while the window has room."""
        room = SEGMENT_WINDOW - sum(len(s.active) for s in group.segq)
        for seg in group.segq:
            while room > 0 and seg.next < len(seg.pieces):
                piece = seg.pieces[seg.next]
                seg.next += 1
                seg.active.append(group.seg_comm.Iallreduce(self._IN_PLACE, piece, seg.op))
                room -= 1
            if seg.next < len(seg.pieces):
                return  # a later operation's segments wait for all of this one's

    def _segment_test(self, seg: _Segmented) -> bool:
        if seg.active:
            try:
                if self._MPI.Request.Testall(seg.active):
                    seg.active = []
            except self._MPI.Exception as exc:
                seg.error = self._error(exc)
                seg.active = []
                seg.next = len(seg.pieces)
        group = seg.group
        self._advance(group)
        if seg.active or seg.next < len(seg.pieces):
            return False
        group.segq.remove(seg)
        self._advance(group)
        if seg.error is not None:
            raise seg.error
        return True

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
        return group.comm.Ireduce_scatter_block(self._msg(buf), self._msg(out),
                                                self._mops[buf.dtype, op])

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
                if not requests[0].Test(self._status):
                    return []
            except self._MPI.Exception as exc:
                return [(0, self._error(exc))]
            except BackendError as exc:
                return [(0, exc)]
            return [(0, self._received(requests[0], self._status))]
        if not _OWN_REQUESTS.isdisjoint(map(type, requests)):  # (C-level scan: every poll)
            return self._test_each(requests)
        statuses = self._statuses
        if len(statuses) < len(requests):
            statuses.extend(self._MPI.Status() for _ in range(len(requests) - len(statuses)))
        try:
            done = self._testsome(requests, statuses)
        except self._MPI.Exception:
            return self._failed_some(requests, statuses)
        if not done:
            return []
        # (Testsome's statuses are in the order of ``done``.)
        return [(i, self._received(requests[i], statuses[j])) for j, i in enumerate(done)]

    def test_one(self, request: Request) -> bool:
        try:
            if not request.Test(self._status):
                return False
        except self._MPI.Exception as exc:
            raise self._error(exc) from exc
        error = self._received(request, self._status)
        if error is not None:
            raise error
        return True

    def _received(self, request: Any, status: Any) -> BaseException | None:
        """For a finished request: a DesyncError if it is a receive and a shorter message
        than it expects came (the stream stays in step: the whole message was taken)."""
        if type(request) not in self._receives:
            return None
        nbytes = request.nbytes
        got = status.Get_count(self._MPI.BYTE)
        if got == nbytes:
            return None
        return DesyncError(
            f"a receive of {nbytes} bytes from rank {status.Get_source()} (tag "
            f"{status.Get_tag()}) got a "
            f"message of {got} bytes: the sender's buffer is smaller than the receiver's; "
            "send and receive buffers of one size")

    def _error(self, exc: Any) -> BackendError:
        """The BackendError reporting an MPI error (an ``MPI.Exception``)."""
        return self._error_of(exc.Get_error_code())

    def _error_of(self, code: int) -> BackendError:
        """The BackendError reporting MPI error ``code``."""
        return BackendError(f"MPI: {self._MPI.Get_error_string(code)}")

    def _test_each(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        """One Test per request (segmented operations are not MPI requests)."""
        out: list[tuple[int, BaseException | None]] = []
        for i, req in enumerate(requests):
            try:
                if req.Test(self._status):
                    out.append((i, self._received(req, self._status)))
            except self._MPI.Exception as exc:
                out.append((i, self._error(exc)))
            except BackendError as exc:
                out.append((i, exc))
        return out

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
                out.append((i, self._error_of(code)))
        return out


#: Requests of this module's own, which MPI's Testsome cannot take.
_OWN_REQUESTS = frozenset({_Segmented, _AnySource})


def _numel(obj: Any) -> int:
    return int(obj.numel()) if hasattr(obj, "numel") and callable(obj.numel) else int(obj.size)


def _displs(counts: Sequence[int]) -> list[int]:
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return displs
