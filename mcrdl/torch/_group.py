"""The process group torch.distributed calls: each collective becomes mcrdl operations.

``ProcessGroupMCRDL`` turns torch's group protocol (``allreduce(tensors, opts)``, ...) into
`Communicator` calls and returns torch ``Work`` objects over their futures; `mcrdl.torch`
registers it as backend "mcrdl".
"""

from __future__ import annotations

import contextvars
import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from _mcrdl_torch import BACKEND_NAME, DEVICES

from ..core._errors import MCRDLError, UnsupportedOperationError
from ..core._types import ReduceOp
from ..engine import CommFuture
from ..front._communicator import Communicator

__all__ = ["BACKEND_NAME", "ProcessGroupMCRDL", "region"]


#: The backend pinned for torch collectives of this thread or task (`mcrdl.torch.backend`).
region: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mcrdl_torch_backend", default=None)


#: torch.distributed as this module uses it: the low-level group protocol that
#: distributed_c10d calls (``allreduce(tensors, opts)``...), which torch's stubs type as the
#: user-facing overloads instead.
_c10d: Any = dist
_RED = _c10d.ReduceOp.RedOpType
#: mcrdl's op for each of torch's, keyed by the value of torch's: its enum members are
#: pybind objects whose hashing and comparison run Python-level code, where their ``.value``
#: is a plain int, and every reduction call looks one up (docs/performance-log.md, "A third
#: host: Intel Xeon at 2.8 GHz, 48 MiB L3", has the cost).
_OPS = {k.value: v for k, v in {
    _RED.SUM: ReduceOp.SUM, _RED.PRODUCT: ReduceOp.PROD, _RED.MIN: ReduceOp.MIN,
    _RED.MAX: ReduceOp.MAX, _RED.AVG: ReduceOp.AVG, _RED.BAND: ReduceOp.BAND,
    _RED.BOR: ReduceOp.BOR, _RED.BXOR: ReduceOp.BXOR}.items()}
_PREMUL_SUM = _RED.PREMUL_SUM.value


# -- work ------------------------------------------------------------------------------


class _Work(_c10d._Work):  # type: ignore[misc]
    """A torch Work over mcrdl futures; ``then`` (copy results into torch's tensors) runs once,
    before the work counts as done for ``wait()`` and for ``get_future()``.

    On device tensors it keeps torch's stream semantics (those of ProcessGroupNCCL):
    ``wait()`` makes the caller's current stream wait for the operations, and the host waits
    only until they are queued on their streams (for the whole operation where it runs on the
    host: a staged MPI or gloo one); ``then`` is queued on that stream behind them. A failure
    found after ``wait()`` returned fails the operations that depend on the failed one (rule 7
    breaks the communicator where one of those was never issued), and `is_success` and
    `exception` report it once the operations are done.
    """

    def __init__(self, futs: Sequence[CommFuture], result: list[torch.Tensor],
                 then: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._futs = list(futs)
        self._result = result
        self._then = then
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def _settle(self) -> BaseException | None:
        """The first error of a finished operation, if any; else run ``then`` (once).

        Called once every operation has finished, or (on a device) once each is queued and
        the current stream waits for it: then's own device work goes on that stream."""
        with self._lock:
            if self._error is None:
                for fut in self._futs:
                    err = fut.exception() if fut.done() else None
                    if err is not None:
                        self._error = err
                        break
            then = self._then
            if self._error is None and then is not None:
                self._then = None
                try:
                    then()
                except Exception as exc:  # noqa: BLE001 - the work's own failure
                    self._error = exc
            return self._error

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None
        if timeout is not None and timeout != datetime.timedelta(0):
            seconds = timeout.total_seconds()
        for fut in self._futs:
            try:
                if fut.device is None:
                    fut.wait(seconds)
                else:  # the caller's current stream waits for it (see the class docstring)
                    fut.wait_stream()
            except TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - raised below, after every future settled
                pass
        error = self._settle()
        if error is not None:
            raise error
        return True

    def is_completed(self) -> bool:
        """Whether every operation has finished; never blocks. It polls mcrdl's engine once
        (as torch's NCCL work queries its events), so that a loop over it moves the operations
        on where nothing else does (no progress thread)."""
        futs = self._futs
        if all(f.done() for f in futs):
            return True
        futs[0]._engine.poll()
        return all(f.done() for f in futs)

    def is_success(self) -> bool:
        if not self.is_completed():
            raise MCRDLError("is_success() on a Work that has not completed; wait() first")
        return self._settle() is None

    def exception(self) -> BaseException | None:
        return self._settle() if self.is_completed() else None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def source_rank(self) -> int:
        """The rank of the group whose message a finished receive got (from any source)."""
        self.wait()
        source = self._futs[0].source if len(self._futs) == 1 else None
        if source is None:
            raise MCRDLError("source_rank() is for a receive's Work")
        return source

    _source_rank = source_rank  # (the name distributed_c10d calls)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        pending = [f for f in self._futs if not f.done()]
        if pending and not pending[0]._engine.has_background:
            # torch waits on this future in C++ (DDP's reducer does), where nothing would
            # poll mcrdl's engine: the future would never complete, and nothing would time out.
            raise MCRDLError(
                "Work.get_future() needs mcrdl's progress thread, and this runtime has none "
                "(MCRDL_PROGRESS_THREAD=0 or mcrdl.init(progress_thread=False)): torch waits "
                "on the future where nothing moves mcrdl's operations; leave the thread on, or "
                "call Work.wait()")
        # On device tensors, a future of those devices: setting its result records an event on
        # their current streams (behind ``then``'s copies), and whoever waits on it or chains
        # to it waits for that event, as with ProcessGroupNCCL's futures.
        devices: list[int | str | torch.device] = [
            d for d in sorted({str(t.device) for t in self._result if t.device.type != "cpu"})]
        tfut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=devices)
        left = [len(self._futs)]
        count = threading.Lock()
        failed: list[BaseException] = []

        def done(_: CommFuture) -> None:
            with count:
                left[0] -= 1
                if left[0]:
                    return
            error = self._settle()
            if error is not None:
                failed.append(error)
            tfut.set_result(self._result)

        def unwrap(fut: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
            if failed:
                raise failed[0]
            return fut.value()

        for fut in self._futs:
            fut.add_done_callback(done)
        # An error raised in a ``then`` callback is the chained future's error in C++ too;
        # ``Future.set_exception`` only sets the result to the exception, which C++ readers
        # of the value (DDP's reducer: a list of tensors) take as it is and crash on
        # (a failed allreduce under DDP ended the process with SIGSEGV).
        return tfut.then(unwrap)


# -- the process group -----------------------------------------------------------------


def _op(opts: Any) -> tuple[ReduceOp, Any]:
    """mcrdl's reduce op for torch's ``opts.reduceOp``, and PREMUL_SUM's factor (else None):
    PREMUL_SUM runs as SUM over the inputs multiplied by the factor (a number, or a tensor
    of one element, possibly different on each rank)."""
    if opts is None:
        return ReduceOp.SUM, None
    red = opts.reduceOp
    kind = getattr(red, "op", red)
    value = kind.value
    if value == _PREMUL_SUM:
        return ReduceOp.SUM, red.factor
    op = _OPS.get(value)
    if op is None:
        raise UnsupportedOperationError(
            f"reduce op {kind} is not supported by the mcrdl backend; it reduces with SUM, "
            f"PRODUCT, MIN, MAX, AVG, PREMUL_SUM, BAND, BOR and BXOR")
    return op, None


def _int_avg(op: ReduceOp, tensors: list[torch.Tensor]) -> bool:
    """Whether AVG on these tensors runs as SUM, then a division truncating toward zero:
    torch's NCCL averages integer tensors so, and its clients rely on it (Lightning averages
    its integer batch counts with AVG on every backend but gloo). mcrdl's own API refuses it."""
    return op is ReduceOp.AVG and any(
        not (t.is_floating_point() or t.is_complex()) for t in tensors)


def _each(one: Callable[[torch.Tensor, torch.Tensor, Any], _Work], outputs: list[torch.Tensor],
          inputs: list[torch.Tensor], opts: Any) -> _Work:
    """A coalesced call: ``one`` per (output, input) pair, as one Work."""
    works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
    return _Work([f for w in works for f in w._futs], outputs)


def _unpack(flat: torch.Tensor, rows: int, outputs: list[torch.Tensor]) -> None:
    """Copy rank ``i``'s ``rows`` rows of a gathered ``flat`` into ``outputs[i]``."""
    for i, o in enumerate(outputs):
        o.copy_(flat[i * rows:(i + 1) * rows].reshape(o.shape))


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (torch's in-place collectives)."""
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a leading dimension (a 0-d tensor as 1 element), sharing its memory."""
    return t.reshape(1) if t.dim() == 0 else t


class ProcessGroupMCRDL(_c10d.ProcessGroup):  # type: ignore[misc]
    """A torch.distributed process group whose collectives run in mcrdl's engine on
    ``comm``. Group ranks are ``comm``'s ranks."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = comm
        #: The backend this group's collectives run on (None: mcrdl's choice).
        self.pinned: str | None = None
        self._group_name = ""
        self._group_desc = ""

    # -- names torch reads ---------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    # What distributed_c10d itself calls and reads: the same accessors.
    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc
    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    # -- the group as its own backend for each device ---------------------------------

    #: torch asks a device's backend whether it splits its communicators to make new groups
    #: (ProcessGroupNCCL does, for ``init_process_group(device_id=...)``): mcrdl makes every
    #: group a communicator of its own through the creator instead.
    supports_splitting = False

    def _get_backend(self, device: torch.device) -> ProcessGroupMCRDL:
        """The backend torch would run ``device``'s collectives on: this group, for each
        device it serves. (torch's own lookup finds nothing: a group written in Python
        replaces the group that would hold a backend per device.)"""
        if torch.device(device).type not in DEVICES:
            raise RuntimeError(f"No backend type associated with device type {device}: "
                               f"backend {BACKEND_NAME!r} serves {', '.join(DEVICES)}")
        return self

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        """Whether the backend allocates its buffers itself (FSDP2 asks): no."""
        return False

    def _backend(self) -> str | None:
        pinned = region.get()
        return pinned if pinned is not None else self.pinned

    def shutdown(self) -> None:
        """``dist.destroy_process_group(group)``: close the group's communicator (after its
        operations), releasing its backend groups, threads and sockets. The default group's
        is mcrdl's world, which ``mcrdl.finalize()`` releases."""
        comm = self.comm
        if comm is not comm.runtime.world:
            comm.close()

    # -- collectives ---------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op, factor = _op(opts)
        if factor is not None:
            for t in tensors:  # (the result overwrites them anyway)
                t.mul_(factor)
        b = self._backend()
        if not _int_avg(op, tensors):
            return _Work([self.comm.allreduce(t, op, backend=b) for t in tensors], tensors)
        futs = [self.comm.allreduce(t, ReduceOp.SUM, backend=b) for t in tensors]

        def then() -> None:
            for t in tensors:
                t.div_(self.comm.size, rounding_mode="trunc")

        return _Work(futs, tensors, then)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        root = 0 if opts is None else opts.rootRank
        b = self._backend()
        return _Work([self.comm.broadcast(t, root, backend=b) for t in tensors], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        op, factor = _op(opts)
        b = self._backend()
        root = opts.rootRank
        if _int_avg(op, tensors):
            futs = [self.comm.reduce(t, root, ReduceOp.SUM, backend=b) for t in tensors]

            def divide() -> None:
                if self.comm.rank == root:
                    for t in tensors:
                        t.div_(self.comm.size, rounding_mode="trunc")

            return _Work(futs, tensors, divide)
        if factor is None:
            return _Work([self.comm.reduce(t, root, op, backend=b) for t in tensors], tensors)
        # Scaled copies: the inputs of the other ranks stay as they were.
        scaled = [t * factor for t in tensors]
        futs = [self.comm.reduce(s, root, op, backend=b) for s in scaled]

        def then() -> None:
            if self.comm.rank == root:
                for t, s in zip(tensors, scaled):
                    t.copy_(s)

        return _Work(futs, tensors, then)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> _Work:
        b = self._backend()
        futs, flats = [], []
        for inp, outputs in zip(inputs, output_lists):
            self._check_list("allgather", outputs, inp)
            flats.append(self._gathered(_rows(inp)))
            futs.append(self.comm.allgather(_rows(inp), out=flats[-1], backend=b))

        def then() -> None:
            for flat, inp, outputs in zip(flats, inputs, output_lists):
                _unpack(flat, _rows(inp).shape[0], outputs)

        return _Work(futs, [o for outputs in output_lists for o in outputs], then)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        """``output_lists[r][i]`` receives input ``i`` of rank ``r`` (per rank, then per
        input: the transpose of ``allgather``'s layout)."""
        n = self.comm.size
        if len(output_lists) != n or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"all_gather_coalesced takes {n} output lists (one per rank) of "
                             f"{len(inputs)} tensors (one per input); got "
                             f"{[len(o) for o in output_lists]}")
        b = self._backend()
        flats = [self._gathered(inp.reshape(-1)) for inp in inputs]
        futs = [self.comm.allgather(inp.reshape(-1), out=flat, backend=b)
                for inp, flat in zip(inputs, flats)]

        def then() -> None:
            for i, (flat, inp) in enumerate(zip(flats, inputs)):
                _unpack(flat, inp.numel(), [outs[i] for outs in output_lists])

        return _Work(futs, [o for outs in output_lists for o in outs], then)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor,
                          opts: Any = None) -> _Work:
        src = _rows(inp)
        out = self._view(output, (src.shape[0] * self.comm.size, *src.shape[1:]), "output")
        if _shares(src, out):
            # In place, as torch allows (FSDP2 gathers its shard from inside the output):
            # mcrdl's operations never read what they write, so the shard is copied first.
            src = src.clone()
        return _Work([self.comm.allgather(src, out=out, backend=self._backend())], [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        return _each(self.all_gather_single, outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> _Work:
        op, factor = _op(opts)
        b = self._backend()
        futs = []
        for out, inputs in zip(outputs, input_lists):
            self._check_list("reduce_scatter", inputs, out)
            src = torch.cat([_rows(t) for t in inputs])
            if factor is not None:
                src.mul_(factor)
            futs.append(self.comm.reduce_scatter(src, op, out=_rows(out), backend=b))
        return _Work(futs, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor,
                              opts: Any = None) -> _Work:
        op, factor = _op(opts)
        out = _rows(output)
        src = self._view(inp, (out.shape[0] * self.comm.size, *out.shape[1:]), "input")
        if factor is not None:
            src = src * factor
        elif _shares(src, out):
            src = src.clone()
        return _Work([self.comm.reduce_scatter(src, op, out=out, backend=self._backend())],
                     [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        return _each(self.reduce_scatter_single, outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> _Work:
        n = self.comm.size
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(f"all_to_all takes {n} input and {n} output tensors (one per "
                             f"rank); got {len(inputs)} and {len(outputs)}")
        dtypes = {t.dtype for t in (*inputs, *outputs)}
        if len(dtypes) != 1:
            raise ValueError(f"all_to_all's tensors must share one dtype; got {sorted(map(str, dtypes))}")
        send = torch.cat([t.reshape(-1) for t in inputs])
        recv = outputs[0].new_empty(sum(t.numel() for t in outputs))
        fut = self.comm.alltoallv(send, [t.numel() for t in inputs],
                                  [t.numel() for t in outputs], out=recv,
                                  backend=self._backend())

        def then() -> None:
            at = 0
            for o in outputs:
                o.copy_(recv[at:at + o.numel()].reshape(o.shape))
                at += o.numel()

        return _Work([fut], outputs, then)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> _Work:
        b = self._backend()
        if not output_split_sizes and not input_split_sizes:
            fut = self.comm.alltoall(_rows(inp), out=_rows(output), backend=b)
        else:
            n = self.comm.size
            send = input_split_sizes or self._even(inp, n, "input")
            recv = output_split_sizes or self._even(output, n, "output")
            fut = self.comm.alltoallv(_rows(inp), send, recv, out=_rows(output), backend=b)
        return _Work([fut], [output])

    alltoall_base = all_to_all_single

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any) -> _Work:
        root = opts.rootRank
        (inp,) = inputs
        if self.comm.rank != root:
            return _Work([self.comm.gather(_rows(inp), root, backend=self._backend())], [])
        self._check_list("gather", output_lists[0], inp)
        flat = self._gathered(_rows(inp))
        fut = self.comm.gather(_rows(inp), root, out=flat, backend=self._backend())

        def then() -> None:
            _unpack(flat, _rows(inp).shape[0], output_lists[0])

        return _Work([fut], output_lists[0], then)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any) -> _Work:
        root = opts.rootRank
        (out,) = outputs
        if self.comm.rank == root:
            self._check_list("scatter", input_lists[0], out)
            src: torch.Tensor | None = torch.cat([_rows(t) for t in input_lists[0]])
        else:
            src = None
        fut = self.comm.scatter(src, root, out=_rows(out), backend=self._backend())
        return _Work([fut], outputs)

    def barrier(self, opts: Any = None) -> _Work:
        return _Work([self.comm.barrier(backend=self._backend())], [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        b = self._backend()
        return _Work([self.comm.send(t, dst, tag, backend=b) for t in tensors], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        b = self._backend()
        return _Work([self.comm.recv(t, src, tag, backend=b) for t in tensors], tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        b = self._backend()
        return _Work([self.comm.recv(t, None, tag, backend=b) for t in tensors], tensors)

    def _gathered(self, rows: torch.Tensor) -> torch.Tensor:
        """A tensor for every member's ``rows`` (a gather's result), on their device: the
        result is written there, so that ``then`` reads it without waiting on the host."""
        return rows.new_empty((rows.shape[0] * self.comm.size, *rows.shape[1:]))

    # -- argument checks -----------------------------------------------------------------

    def _check_list(self, what: str, tensors: list[torch.Tensor], like: torch.Tensor) -> None:
        n = self.comm.size
        if len(tensors) != n:
            raise ValueError(f"{what} takes a list of {n} tensors (one per rank) on this "
                             f"group; got {len(tensors)}")
        for t in tensors:
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(f"{what}: every tensor of the list must have the shape and "
                                 f"dtype of the input ({tuple(like.shape)}, {like.dtype}); got "
                                 f"({tuple(t.shape)}, {t.dtype})")

    @staticmethod
    def _view(t: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        if t.numel() != numel:
            raise ValueError(f"the {what} tensor has {t.numel()} elements; this collective "
                             f"needs {numel} (shape {shape}) on a group of this size")
        if not t.is_contiguous():
            raise ValueError(f"the {what} tensor is not contiguous; pass .contiguous()")
        return t.view(shape)

    @staticmethod
    def _even(t: torch.Tensor, n: int, what: str) -> list[int]:
        rows = _rows(t).shape[0]
        if rows % n:
            raise ValueError(f"all_to_all_single: the {what} tensor's {rows} rows do not "
                             f"split evenly over {n} ranks; pass split sizes")
        return [rows // n] * n
