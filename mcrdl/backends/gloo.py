"""The gloo backend: torch.distributed's ProcessGroupGloo, used directly, one per communicator.

Quirks beyond the contract:
- Process groups are made from the runtime's store under a prefix per communicator, by the
  members alone: no world-wide ``new_group`` call, no default group, nothing global touched.
  Each binds its sockets to the bootstrap's host (loopback on one host), and connects to
  every member while it is made (group creation is collective anyway: members make their
  groups in the same order). Lazy connection was rejected: a send connects in the caller's
  thread, and blocked for minutes in ``start_send`` when its peer had broken the
  communicator and never touched the group again (rule 1 of docs/design.md: never block in a
  backend).
- Collectives run on gloo's own threads (``self_progressing``): pollers must yield the CPU to
  them. Completion is ``Work.is_completed()``; a failed Work reports through ``Work.wait()``.
- send and recv Work never report completion until ``wait()`` is called, and a ``wait()``
  with a short timeout breaks a send/recv pair for good; so each of those in flight is
  waited on by a thread of a small pool (``_Waiters``), which marks it done. A single waiter
  thread taking them in order was rejected: a later send's completion could then wait for an
  earlier recv whose sender needs that completion first (a deadlock of a well-formed
  program).
- torch's gloo reduce_scatter is an allreduce of a copy of the input, then a copy of this
  member's chunk out of it, made in the Work's ``wait()`` (so it, too, never reports
  completion before one). mcrdl runs those same two steps itself (`_Chunked`): a pollable
  allreduce, and the chunk copied by whoever sees it complete. Handing it to the pool
  instead cost two thread hand-offs per operation, which left small reduce_scatters well
  behind raw torch.distributed (docs/performance-log.md, "gloo reduce_scatter without a pool
  thread").
- gloo cannot move int16, uint16, uint32, uint64 or (in gather-type operations) complex
  tensors; mcrdl moves them as bit-identical views (float16, int32, int64, real pairs).
  They do not reduce, except complex SUM and AVG.
- gloo's reduce overwrites non-root inputs; non-roots reduce from a scratch copy instead.
- Numpy buffers travel as ``torch.from_numpy`` views (zero copy).
"""

from __future__ import annotations

import datetime
import importlib.util
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core._errors import BackendError
from ..core._forever import forever
from ..core._types import DType, OpKind, ReduceOp
from ._contract import Backend, Capabilities, Rendezvous, Request

if TYPE_CHECKING:
    from ..core._buffers import Buffer

__all__ = ["GlooBackend"]

_NATIVE_ORDERED = frozenset({DType.BOOL, DType.UINT8, DType.INT8, DType.INT32, DType.INT64,
                             DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
_COMPLEX = frozenset({DType.COMPLEX64, DType.COMPLEX128})
_FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
#: Bit-identical stand-ins for the dtypes gloo cannot move (torch dtype names).
_MOVE_AS = {DType.INT16: "float16", DType.UINT16: "float16", DType.UINT32: "int32",
            DType.UINT64: "int64"}



def deadline(timeout: float) -> float:
    """gloo's own deadline for an operation, given the runtime's ``timeout``: later by half
    of it and 2 s more. The runtime's timeout must fire first, as it does on every other
    backend: it names the operation and the peers it lacks, dumps the flight recorder and
    breaks the communicator on every member, where gloo's fails one Work with "Timed out
    waiting". Its deadlines are checked every ``min(timeout / 8, 0.25)`` s by whoever
    polls, and gloo's clock starts only once the operation is issued; with equal deadlines,
    gloo's fired first."""
    return timeout * 1.5 + 2.0

class _GlooGroup:
    """A process group, and the store its members met through, through which the groups
    made from it meet too (after a shrink, a store of the survivors': the bootstrap's may
    be gone with rank 0)."""

    __slots__ = ("pg", "rank", "size", "store")

    def __init__(self, pg: Any, rank: int, size: int, store: Any) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size
        self.store = store

    def __repr__(self) -> str:
        return f"<gloo group rank={self.rank}/{self.size}>"


class _Waited:
    """A Work that cannot be polled, being waited on by a pool thread."""

    __slots__ = ("work", "done", "error", "event")

    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = False
        self.error: BaseException | None = None
        self.event = threading.Event()


class _Chunked:
    """A reduce_scatter in flight: an allreduce of ``whole`` (a copy of the input), then this
    member's chunk of it copied into ``out`` by ``test()`` once the allreduce completed (a
    ``Work``'s two methods that ``test()`` calls; ``block()`` waits on the allreduce itself,
    outside the engine's lock, and leaves the copy to the next poll)."""

    __slots__ = ("work", "whole", "out", "rank", "size")

    def __init__(self, work: Any, whole: Any, out: Any, rank: int, size: int) -> None:
        self.work = work
        self.whole = whole
        self.out = out
        self.rank = rank
        self.size = size

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self) -> bool:
        """Called by ``test()``, under the engine's lock, once the allreduce completed (once:
        the engine forgets a request it reported)."""
        self.work.wait()
        self.out.copy_(self.whole.chunk(self.size)[self.rank])
        return True


class _Waiters:
    """Threads that block in ``Work.wait()`` (which releases the GIL) for unpollable Work.

    Invariants: there are at least as many threads as jobs outstanding, so no job waits
    behind another.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Waited | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._threads = 0

    def submit(self, work: Any) -> _Waited:
        job = _Waited(work)
        with self._lock:
            self._outstanding += 1
            spawn = self._outstanding > self._threads
            if spawn:
                self._threads += 1
        if spawn:
            threading.Thread(target=self._run, name="mcrdl-gloo-p2p", daemon=True).start()
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.work.wait()
            except Exception as exc:  # noqa: BLE001 - reported through test()
                job.error = BackendError(f"gloo: {exc}")
            job.work = None
            with self._lock:
                self._outstanding -= 1
            job.done = True
            job.event.set()

    def close(self) -> None:
        with self._lock:
            n = self._threads
            self._threads = 0
        for _ in range(n):
            self._jobs.put(None)


class GlooBackend(Backend):
    """gloo through torch.distributed (see the module docstring for its quirks)."""

    name = "gloo"
    capabilities = Capabilities(
        ops=frozenset(OpKind),
        dtypes=frozenset(DType),
        reductions={
            ReduceOp.SUM: _NATIVE_ORDERED | _COMPLEX,
            ReduceOp.PROD: _NATIVE_ORDERED,
            ReduceOp.MIN: _NATIVE_ORDERED,
            ReduceOp.MAX: _NATIVE_ORDERED,
            ReduceOp.AVG: _FLOATS | _COMPLEX,
            ReduceOp.BAND: _NATIVE_ORDERED - _FLOATS,
            ReduceOp.BOR: _NATIVE_ORDERED - _FLOATS,
            ReduceOp.BXOR: _NATIVE_ORDERED - _FLOATS,
        },
        cancel=False,
        self_progressing=True,
        blocking_wait=True,
        waits_in_threads=True,
        aborts_on_mismatch=True,
        regroups_after_loss=True,
    )

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch") is None:
            return False
        try:
            import torch.distributed as dist

            return bool(dist.is_available() and dist.is_gloo_available())
        except Exception:  # noqa: BLE001 - is_available never raises
            return False

    def __init__(self, bootstrap: Rendezvous) -> None:
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroupGloo

        self._torch = torch
        self._dist = dist
        self._PG = ProcessGroupGloo
        self._host = bootstrap.host
        self._timeout = datetime.timedelta(seconds=deadline(bootstrap.timeout))
        self._waiters = _Waiters()
        self._move_as = {dt: getattr(torch, name) for dt, name in _MOVE_AS.items()}
        red = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.PROD: dist.ReduceOp.PRODUCT,
               ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
               ReduceOp.AVG: dist.ReduceOp.AVG, ReduceOp.BAND: dist.ReduceOp.BAND,
               ReduceOp.BOR: dist.ReduceOp.BOR, ReduceOp.BXOR: dist.ReduceOp.BXOR}
        self._red = red
        self._allreduce_opts = {}
        for op, r in red.items():
            opts = dist.AllreduceOptions()
            opts.reduceOp = r  # type: ignore[assignment]
            self._allreduce_opts[op] = opts
        self._world = self._make(f"world/{bootstrap.size}", bootstrap.rank, bootstrap.size,
                                 bootstrap.store())

    def _make(self, tag: str, rank: int, size: int, store: Any) -> _GlooGroup:
        opts = self._PG._Options()  # type: ignore[attr-defined]
        opts._devices = [self._PG.create_device(hostname=self._host, lazy_init=False)]
        opts._threads = 2
        opts._timeout = self._timeout
        prefixed = self._dist.PrefixStore(f"mcrdl/{tag}", store)  # type: ignore[attr-defined]
        return _GlooGroup(self._PG(prefixed, rank, size, opts), rank, size, store)

    # -- groups --------------------------------------------------------------------------

    def world(self) -> _GlooGroup:
        return self._world

    def create_group(self, parent: _GlooGroup, members: Sequence[int], tag: str) -> _GlooGroup:
        return self._make(tag, list(members).index(parent.rank), len(members), parent.store)

    def regroup(self, parent: _GlooGroup, members: Sequence[int], tag: str,
                store: Any) -> _GlooGroup:
        """The members meet through ``store`` alone (and so will the groups made from this
        one): the processes of ``parent`` that are gone take no part."""
        return self._make(tag, list(members).index(parent.rank), len(members), store)

    def free_group(self, group: _GlooGroup) -> None:
        group.pg = None

    def abandon(self, group: _GlooGroup) -> None:
        """Keep ``group``'s process group for the rest of the process: destroying it joins
        gloo's threads, which wait in an abandoned collective until gloo's own timeout (a
        freed group blocked ``close()`` until the peer process exited), and closes the
        connections on which peers may still wait (they saw "connection closed" instead of
        the cause that broke the communicator)."""
        if group.pg is not None:
            # Not a module-level list: the interpreter's exit empties those, and the exit
            # then blocked until the peer process ended; never destroyed, the group's
            # threads end with the process instead.
            forever(group.pg)

    def close(self) -> None:
        self._waiters.close()
        self._world.pg = self._world.store = None

    # -- views ---------------------------------------------------------------------------

    def _moved(self, buf: Buffer) -> Any:
        """``buf`` as a tensor gloo can move byte for byte."""
        t = buf.torch()
        dt = buf.dtype
        if dt in _COMPLEX:
            return self._torch.view_as_real(t)
        stand_in = self._move_as.get(dt)
        return t if stand_in is None else t.view(stand_in)

    # -- operations ----------------------------------------------------------------------

    def start_send(self, group: _GlooGroup, buf: Buffer, dst: int, tag: int) -> Request:
        return self._waiters.submit(group.pg.send([buf.torch()], dst, tag))

    def start_recv(self, group: _GlooGroup, buf: Buffer, src: int, tag: int) -> Request:
        return self._waiters.submit(group.pg.recv([buf.torch()], src, tag))

    def start_broadcast(self, group: _GlooGroup, buf: Buffer, root: int) -> Request:
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        return group.pg.broadcast([self._moved(buf)], opts)

    def start_reduce(self, group: _GlooGroup, buf: Buffer, root: int, op: ReduceOp) -> Request:
        opts = self._dist.ReduceOptions()
        opts.reduceOp = self._red[op]  # type: ignore[assignment]
        opts.rootRank = root
        t = buf.torch()
        return group.pg.reduce([t if group.rank == root else t.clone()], opts)

    def start_allreduce(self, group: _GlooGroup, buf: Buffer, op: ReduceOp) -> Request:
        return group.pg.allreduce([buf.torch()], self._allreduce_opts[op])

    def start_gather(
        self, group: _GlooGroup, buf: Buffer, out: Buffer | None, root: int
    ) -> Request:
        opts = self._dist.GatherOptions()
        opts.rootRank = root
        outputs = [list(self._moved(out).chunk(group.size))] if out is not None else []
        return group.pg.gather(outputs, [self._moved(buf)], opts)

    def start_allgather(self, group: _GlooGroup, buf: Buffer, out: Buffer) -> Request:
        return group.pg._allgather_base(self._moved(out), self._moved(buf))

    def start_scatter(
        self, group: _GlooGroup, buf: Buffer | None, out: Buffer, root: int
    ) -> Request:
        opts = self._dist.ScatterOptions()
        opts.rootRank = root
        inputs = [list(self._moved(buf).chunk(group.size))] if buf is not None else []
        return group.pg.scatter([self._moved(out)], inputs, opts)

    def start_reduce_scatter(
        self, group: _GlooGroup, buf: Buffer, out: Buffer, op: ReduceOp
    ) -> Request:
        whole = buf.torch().clone()
        work = group.pg.allreduce([whole], self._allreduce_opts[op])
        return _Chunked(work, whole, out.torch(), group.rank, group.size)

    def start_alltoall(self, group: _GlooGroup, buf: Buffer, out: Buffer) -> Request:
        return group.pg.alltoall_base(self._moved(out), self._moved(buf), [], [])

    def start_alltoallv(
        self,
        group: _GlooGroup,
        buf: Buffer,
        send_counts: Sequence[int],
        out: Buffer,
        recv_counts: Sequence[int],
    ) -> Request:
        return group.pg.alltoall_base(self._moved(out), self._moved(buf), list(recv_counts),
                                      list(send_counts))

    def start_barrier(self, group: _GlooGroup) -> Request:
        return group.pg.barrier(self._dist.BarrierOptions())

    # -- completion ----------------------------------------------------------------------

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        out: list[tuple[int, BaseException | None]] = []
        for i, work in enumerate(requests):
            if type(work) is _Waited:
                if work.done:
                    out.append((i, work.error))
            elif work.is_completed():
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - the Work's failure, reported as ours
                    out.append((i, BackendError(f"gloo: {exc}")))
                else:
                    out.append((i, None))
        return out

    def thread_held(self, request: Request) -> Any:
        if type(request) is _Waited and not request.done:
            return request.event
        return None

    def block(self, request: Request, timeout: float) -> bool:
        if type(request) is _Waited:
            return request.event.wait(timeout)
        if type(request) is _Chunked:
            request = request.work
        # Work.wait counts whole milliseconds, and 0 means no timeout at all: a shorter
        # slice would wait for the whole operation.
        try:
            request.wait(datetime.timedelta(seconds=max(timeout, 1e-3)))
        except Exception:  # noqa: BLE001 - a slice that ran out, or a failure test() reports
            return bool(request.is_completed())
        return True
