"""Communicator: the front API. Checks every call, picks its backend, and submits it to the engine.

Every operation returns a `CommFuture` at once; see docs/design.md §1 for the semantics shared by
all of them (in-place results, ``out=`` allocation, program order across backends, ``after=``).
Bad input raises here, on the calling rank, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..core._buffers import Buffer, as_buffer, new_buffer
from ..core._errors import CommClosedError, MCRDLError, UnsupportedOperationError
from ..core._types import COLLECTIVES, DType, OpKind, ReduceOp
from ..engine import ANY_PEER, CommFuture, take_source
from ..engine._names import Names
from ..engine._states import CHECK_KIND
from ._alltoallv import Exchanged
from ._debug import FIELDS, check, describe, of_operation, task_id
from ._validate import (
    check_counts,
    check_name,
    check_op,
    check_peer,
    check_rank,
    check_tag,
    out_buffer,
    split_shape,
    with_rows,
)

if TYPE_CHECKING:
    from ..engine import Lane
    from ._runtime import Runtime
    from ._select import Router, Slot

__all__ = ["Communicator"]

_SUM = ReduceOp.SUM
_AVG = ReduceOp.AVG
_ALLREDUCE = OpKind.ALLREDUCE
_ALLGATHER = OpKind.ALLGATHER
_ALLTOALL = OpKind.ALLTOALL
_BROADCAST = OpKind.BROADCAST
_REDUCE_SCATTER = OpKind.REDUCE_SCATTER
_NO_RANGES: tuple[tuple[int, int], ...] = ()
_NAMES = {kind: kind.value for kind in OpKind}  # Enum.value is a property; a dict read is cheaper


class Communicator:
    """A group of ranks, reachable through every backend the runtime brought up.

    Made by ``mcrdl.init()`` (the world) and by ``split``. All members must submit the same
    collectives in the same order (the rule MPI and NCCL impose); which backend runs each one
    may differ per call and never needs to match anything but itself across ranks.

    Every collective also takes ``name=``: a string its members share (a parameter's name,
    ``"grad/layer3"``). Named collectives are matched across the members by name, whatever
    order each member submits them in, so concurrent asyncio tasks may submit them in any
    order (rule 8 of docs/design.md; `mcrdl.engine._names`). A name stands for one operation at a
    time on a communicator: submitting it again before the first has finished raises
    ValueError. A name that some member never submits fails with DesyncError, naming that
    member, once the runtime's timeout has passed.

    Invariants:
    - ``_slots`` maps each backend name to that backend's group and lane for this communicator;
      ``_named`` the same for named operations (their own groups and lanes, rule 8).
    - ``_seq`` counts the operations submitted on this communicator (the ``#n`` in reprs).
    - ``_slots[*].lane.comm`` is one engine `CommState` for all of them: when it breaks
      (docs/design.md rule 7), every operation on this communicator fails with CommBrokenError.
    """

    def __init__(self, runtime: Runtime, name: str, slots: dict[str, Slot],
                 members: tuple[int, ...], debug: Slot | None = None,
                 named: dict[str, Slot] | None = None) -> None:
        self._runtime = runtime
        self._debug = debug
        #: The task check (`mcrdl.front._taskcheck`), or None.
        self._task_check = runtime.task_check
        self._named = named or {}
        self._cseq = 0  # collectives submitted (debug mode's fingerprint sequence)
        self._engine = runtime.engine
        #: Its named operations' agreement (the runtime gives every communicator one).
        self._names = cast("Names", next(iter(slots.values())).lane.comm.names)
        self._selector = runtime.selector
        self.name = name
        #: The world ranks of the members, in this communicator's rank order.
        self.members = members
        self._slots = slots
        first = next(iter(slots.values()))
        #: This process's rank in the communicator.
        self.rank: int = first.group.rank
        #: Number of ranks in the communicator.
        self.size: int = first.group.size
        self._seq = 0
        self._splits = 0
        self._closed = False
        self._choice_cache: dict[tuple[Any, ...], Any] = {}  # (slot, emulate) or a Router
        #: The devices the runtime's backends reach, by name (empty: host memory only).
        self._devices = runtime.devices
        self._sigs: dict[tuple[Any, ...], str] = {}  # named collectives' signatures
        #: The last receive from any source per (backend, tag), while it may be unfinished.
        self._any_source: dict[tuple[str, int], CommFuture] = {}

    # -- identity ------------------------------------------------------------------------

    @property
    def backends(self) -> tuple[str, ...]:
        """Names of the backends this communicator can run operations on."""
        return tuple(self._slots)

    def slots(self) -> list[Slot]:
        """Every slot of this communicator, the named and debug lanes' included."""
        return [*self._slots.values(), *self._named.values(),
                *([self._debug] if self._debug is not None else [])]

    @property
    def runtime(self) -> Runtime:
        """The runtime this communicator belongs to."""
        return self._runtime

    @property
    def closed(self) -> bool:
        """True after ``close()`` (or the runtime's finalization)."""
        return self._closed or self._runtime.finalized

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return (
            f"<Communicator {self.name} rank={self.rank}/{self.size} "
            f"backends={','.join(self._slots)}{state}>"
        )

    # -- plumbing ------------------------------------------------------------------------

    def _choose(
        self, kind: OpKind, dtype: DType | None, op: ReduceOp | None, nbytes: int, backend: Any,
        device: str | None,
    ) -> tuple[Slot, bool]:
        """The slot to run a message of ``nbytes`` (global size) on buffers on ``device``
        (None: it has none) on, and whether AVG must be emulated (SUM, then divide)."""
        choice = self._choice_cache.get((kind, dtype, op, backend, device))
        if choice is None:
            choice = self._decide(kind, dtype, op, backend, device)
        return choice if type(choice) is tuple else choice.pick(nbytes)  # type: ignore[union-attr]

    def _decide(
        self, kind: OpKind, dtype: DType | None, op: ReduceOp | None, backend: Any,
        device: str | None,
    ) -> tuple[Slot, bool] | Router:
        """``(slot, emulate_avg)``, or a `Router` where auto's choice depends on the global
        message size; cached per (kind, dtype, op, backend, device), since a choice depends
        on nothing else (rule 4). Closing the communicator empties the cache, so a cache hit
        also means "open".
        """
        key = (kind, dtype, op, backend, device)
        hit: tuple[Slot, bool] | Router | None = self._choice_cache.get(key)
        if hit is not None:
            return hit
        if self._closed:  # finalize closes every communicator
            raise CommClosedError(
                f"cannot {kind.value} on {self.name}: the runtime was finalized"
                if self._runtime.finalized
                else f"cannot {kind.value} on {self!r}: the communicator is closed"
            )
        choice = self._choice_cache[key] = self._selector.choose(
            self._slots, kind, dtype, op, backend, self.size, device)
        return choice

    def _mark_closed(self) -> None:
        self._closed = True
        self._choice_cache.clear()

    def _submit(
        self,
        kind: OpKind,
        slot: Slot,
        start: Any,
        args: tuple[Any, ...],
        reads: tuple[tuple[int, int], ...],
        writes: tuple[tuple[int, int], ...],
        result: Any,
        nbytes: int,
        after: Sequence[CommFuture],
        finish: Any = None,
        hold: Any = None,
        route: tuple[tuple[Lane, ...], Any] | None = None,
        stream: tuple[int, int, bool] | None = None,
        name: str | None = None,
    ) -> CommFuture:
        """Describe the operation as its future and submit it: every operation comes here.

        ``hold``: the caller's objects the backend reads or writes by address, other than
        ``result`` (the engine keeps them alive while the backend may use them). ``route``:
        the candidate lanes and the chooser of an operation whose backend is decided later
        (``Engine.submit``); ``slot`` is then only a placeholder among them. ``stream``:
        ``(peer, tag, sends)`` for a send or receive (what its peer matches it among).
        ``name``: the collective's ``name=`` (checked by `check_name`), which its members
        match it by instead of its position (rule 8; `mcrdl.engine._names`). Debug mode
        checks a named collective by its signature, which travels with its name, instead of
        by its position.
        """
        device = self._device_of(args) if self._devices else None  # (may refuse: first)
        if name is not None:  # on its backend's named lane, placed where the members agree
            check_name(name)
            self._seq = seq = self._seq + 1
            named = self._named[slot.backend.name]
            fut = CommFuture(_NAMES[kind], named.lane, seq, start, (named.group, *args[1:]),
                             reads, writes, result, nbytes, finish, hold)
            fut.name = name
            fut.device = device
            sig = self._signature(kind, slot.backend.name, args, device is not None)
            return self._engine.submit(fut, after, named=(self._names, sig))
        self._seq = seq = self._seq + 1
        fut = CommFuture(_NAMES[kind], slot.lane, seq, start, args, reads, writes, result,
                         nbytes, finish, hold, stream)
        fut.device = device
        if self._debug is not None and kind in COLLECTIVES:
            after = self._checked(kind, None if route else slot.backend.name, args, after)
        self._engine.submit(fut, after, route)
        if self._task_check is not None:  # (after the submission: its warning may raise)
            self._task_check(fut)
        return fut

    def _device_of(self, args: tuple[Any, ...]) -> Any:
        """The `Device` the operation's buffers are on (None: host memory; ``_out`` made sure
        that an operation's buffers share one device)."""
        for arg in args:
            if type(arg) is Buffer and arg.device != "cpu":
                device = self._devices.get(arg.device)
                if device is None:
                    raise ValueError(
                        f"a buffer is on {arg.device}, but this runtime reaches "
                        f"{', '.join(sorted(self._devices))} (the GPU current at init()); call "
                        f"torch.cuda.set_device(...) before mcrdl.init(), one GPU per process")
                return device
        return None

    def _checked(self, kind: OpKind, backend: str | None, args: tuple[Any, ...],
                 after: Sequence[CommFuture]) -> list[CommFuture]:
        """Debug mode: ``after`` plus this collective's fingerprint check, which it then
        waits for; ``backend`` is None for one routed by its agreed size (decided later, the
        same on every member by rule 4)."""
        names = tuple(sorted(self._slots))  # rank-invariant, unlike a selector's order
        self._cseq = cseq = self._cseq + 1
        fp = of_operation(cseq, kind, backend, args, names, task_id())
        dbg = cast("Slot", self._debug)  # (called in debug mode only)
        table = np.empty((self.size, FIELDS), dtype=np.int64)
        name = self.name

        def finish(_fut: CommFuture) -> None:
            check(table, name, names)

        mine = fp.reshape(1, FIELDS)
        check_fut = CommFuture(
            CHECK_KIND, dbg.lane, cseq, dbg.backend.start_allgather,
            (dbg.group, new_buffer(mine, False, DType.INT64),
             new_buffer(table, False, DType.INT64)),
            _NO_RANGES, _NO_RANGES, table, fp.nbytes, finish, mine)
        return [*after, self._engine.submit(check_fut)]

    def _signature(self, kind: OpKind, backend: str, args: tuple[Any, ...],
                   on_device: bool) -> str:
        """A named collective's signature: what its members must agree on, as text; kept
        per (operation, backend, arguments' dtypes and shapes), since a training step names
        the same shapes every iteration and making the text each time would show in a small
        operation's overhead. ``on_device`` (the operation's ``device`` is set) is part of
        it: fusion reads it, and every member must fuse alike (`mcrdl.engine._fusion`)."""
        parts = [kind, backend, on_device]
        for a in args[1:]:  # (a loop: a comprehension's frame cost more than the rest)
            if type(a) is Buffer:
                parts.append((a.dtype, a.obj.shape))
            else:
                parts.append(a)
        key = tuple(parts)
        sig = self._sigs.get(key)
        if sig is None:
            if len(self._sigs) >= 4096:  # (alltoallv's counts vary: never grow unbounded)
                self._sigs.clear()
            names = sorted(self._slots)
            sig = describe(of_operation(0, kind, backend, args, names), names, seq=False)
            if on_device:
                sig += " in device memory"
            self._sigs[key] = sig
        return sig

    def _avg_finish(self, target: Any) -> Any:
        size = self.size

        def finish(_fut: CommFuture) -> None:
            if isinstance(target, np.ndarray):
                np.divide(target, size, out=target)
            else:
                target.div_(size)

        return finish

    # -- point to point ------------------------------------------------------------------

    def send(
        self, buf: Any, dst: int, tag: int = 0, *, backend: str | None = None,
        after: Sequence[CommFuture] = (),
    ) -> CommFuture:
        """Send ``buf`` to rank ``dst``; resolves to None once ``buf`` may be reused."""
        b = as_buffer(buf, "buf")
        dst = check_peer("dst", dst, self.size, self.rank)
        tag = check_tag(tag)
        slot, _ = self._choose(OpKind.SEND, b.dtype, None, b.nbytes, backend, b.device)
        return self._submit(OpKind.SEND, slot, slot.backend.start_send, (slot.group, b, dst, tag),
                            b.ranges, _NO_RANGES, None, b.nbytes, after, hold=b.obj,
                            stream=(dst, tag, True))

    def recv(
        self, buf: Any, src: int | None, tag: int = 0, *, backend: str | None = None,
        after: Sequence[CommFuture] = (),
    ) -> CommFuture:
        """Receive into ``buf`` from rank ``src`` (the same backend the sender chose);
        resolves to ``buf``.

        ``src=None`` receives from any rank, whichever message of ``tag`` the backend
        matches first (MPI; host buffers); ``fut.source`` then says whose it was. Until it
        has finished, no other receive of ``tag`` on its backend may be submitted: which
        position on which peer's stream it takes is known only then (rule 7).
        """
        b = as_buffer(buf, "buf", True)
        if src is not None:
            src = check_peer("src", src, self.size, self.rank)
        tag = check_tag(tag)
        slot, _ = self._choose(OpKind.RECV, b.dtype, None, b.nbytes, backend, b.device)
        name = slot.backend.name
        if self._any_source:
            self._refuse_beside_any_source(name, tag)
        if src is not None:
            return self._submit(OpKind.RECV, slot, slot.backend.start_recv,
                                (slot.group, b, src, tag), _NO_RANGES, b.ranges, buf, b.nbytes,
                                after, stream=(src, tag, False))
        if not slot.backend.capabilities.any_source or b.device != "cpu":
            can = [n for n, s in self._slots.items() if s.backend.capabilities.any_source]
            raise UnsupportedOperationError(
                f"a receive from any source runs on {', '.join(can) or 'no backend here'}, "
                f"into host memory; this one would be on {name} into {b.device} memory: "
                "pass backend=, a host buffer, or src=")
        fut = self._submit(OpKind.RECV, slot, slot.backend.start_recv_any, (slot.group, b, tag),
                           _NO_RANGES, b.ranges, buf, b.nbytes, after, take_source,
                           stream=(ANY_PEER, tag, False))
        self._any_source[name, tag] = fut
        return fut

    def _refuse_beside_any_source(self, backend: str, tag: int) -> None:
        """Refuse a receive of ``tag`` on ``backend`` while one from any source of that tag
        is unfinished there: which position it takes is known only when it has matched."""
        pending = self._any_source.get((backend, tag))
        if pending is None:
            return
        if pending.done():
            del self._any_source[backend, tag]
            return
        raise ValueError(
            f"a receive of tag {tag} on {backend} while receive#{pending.seq} from any "
            f"source of that tag is unfinished: wait for it first, or use another tag")

    # -- collectives ---------------------------------------------------------------------

    def broadcast(
        self, buf: Any, root: int = 0, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Copy ``root``'s ``buf`` into every member's ``buf``; resolves to ``buf``."""
        b = as_buffer(buf, "buf", True)
        root = check_rank("root", root, self.size)
        slot, _ = self._choose(_BROADCAST, b.dtype, None, b.nbytes, backend, b.device)
        r = b.ranges
        reads, writes = (r, _NO_RANGES) if root == self.rank else (_NO_RANGES, r)
        return self._submit(_BROADCAST, slot, slot.backend.start_broadcast,
                            (slot.group, b, root), reads, writes, buf, b.nbytes, after, name=name)

    def reduce(
        self, buf: Any, root: int = 0, op: ReduceOp = _SUM, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Reduce every member's ``buf`` into ``root``'s; others' stay as they were."""
        b = as_buffer(buf, "buf", True)
        root = check_rank("root", root, self.size)
        op = check_op(op)
        slot, emulate = self._choose(OpKind.REDUCE, b.dtype, op, b.nbytes, backend,
                                     b.device)
        finish = None
        if emulate:
            op = _SUM
            if root == self.rank:
                finish = self._avg_finish(buf)
        r = b.ranges
        reads, writes = (_NO_RANGES, r) if root == self.rank else (r, _NO_RANGES)
        return self._submit(OpKind.REDUCE, slot, slot.backend.start_reduce,
                            (slot.group, b, root, op), reads, writes, buf, b.nbytes, after,
                            finish, name=name)

    def allreduce(
        self, buf: Any, op: ReduceOp = _SUM, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Reduce every member's ``buf`` into every member's ``buf``; resolves to ``buf``."""
        b = as_buffer(buf, "buf", True)
        op = check_op(op)
        slot, emulate = self._choose(_ALLREDUCE, b.dtype, op, b.nbytes, backend, b.device)
        finish = None
        if emulate:
            op = _SUM
            finish = self._avg_finish(buf)
        return self._submit(_ALLREDUCE, slot, slot.backend.start_allreduce, (slot.group, b, op),
                            _NO_RANGES, b.ranges, buf, b.nbytes, after, finish, name=name)

    def gather(
        self, buf: Any, root: int = 0, out: Any = None, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Concatenate members' ``buf`` along dim 0 at ``root``; resolves to None elsewhere.

        ``out`` is used on the root only; elsewhere it is left untouched.
        """
        b = as_buffer(buf, "buf")
        root = check_rank("root", root, self.size)
        shape = b.obj.shape
        if not shape:
            raise ValueError("gather concatenates along dim 0, but buf is 0-dimensional; "
                             "pass buf.reshape(1)")
        slot, _ = self._choose(OpKind.GATHER, b.dtype, None, b.nbytes * self.size, backend,
                               b.device)
        o = None
        if root == self.rank:
            o = out_buffer(OpKind.GATHER, out, b, with_rows(shape, shape[0] * self.size),
                           self.size)
        return self._submit(OpKind.GATHER, slot, slot.backend.start_gather,
                            (slot.group, b, o, root), b.ranges,
                            o.ranges if o is not None else _NO_RANGES,
                            o.obj if o is not None else None, b.nbytes, after, hold=b.obj,
                            name=name)

    def allgather(
        self, buf: Any, out: Any = None, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Concatenate members' ``buf`` along dim 0 on every member; resolves to ``out``."""
        b = as_buffer(buf, "buf")
        shape = b.obj.shape
        if not shape:
            raise ValueError("allgather concatenates along dim 0, but buf is 0-dimensional; "
                             "pass buf.reshape(1)")
        slot, _ = self._choose(_ALLGATHER, b.dtype, None, b.nbytes * self.size, backend,
                               b.device)
        o = out_buffer(_ALLGATHER, out, b, with_rows(shape, shape[0] * self.size), self.size)
        return self._submit(_ALLGATHER, slot, slot.backend.start_allgather, (slot.group, b, o),
                            b.ranges, o.ranges, o.obj, b.nbytes, after, hold=b.obj, name=name)

    def scatter(
        self, buf: Any, root: int = 0, out: Any = None, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Split ``root``'s ``buf`` along dim 0; member i receives chunk i in ``out``.

        Off the root, ``buf`` only gives the shape and dtype (its contents are not read) and
        may be None when ``out`` is given.
        """
        root = check_rank("root", root, self.size)
        if buf is None and root != self.rank and out is not None:
            o = as_buffer(out, "out", True)
            if not o.shape:
                raise ValueError("scatter's out must have a leading dimension; got 0-d")
            b = None
            dtype, nbytes, device = o.dtype, o.nbytes * self.size, o.device
        else:
            b = as_buffer(buf, "buf")
            shape = split_shape(OpKind.SCATTER, b, self.size)
            o = out_buffer(OpKind.SCATTER, out, b, with_rows(shape, shape[0] // self.size),
                           self.size)
            dtype, nbytes, device = b.dtype, b.nbytes, b.device
        slot, _ = self._choose(OpKind.SCATTER, dtype, None, nbytes, backend, device)
        send = b if root == self.rank else None
        return self._submit(OpKind.SCATTER, slot, slot.backend.start_scatter,
                            (slot.group, send, o, root),
                            send.ranges if send is not None else _NO_RANGES,
                            o.ranges, o.obj, o.nbytes, after,
                            hold=send.obj if send is not None else None, name=name)

    def reduce_scatter(
        self, buf: Any, op: ReduceOp = _SUM, out: Any = None, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Reduce members' ``buf``; member i receives chunk i (along dim 0) in ``out``."""
        b = as_buffer(buf, "buf")
        op = check_op(op)
        shape = split_shape(_REDUCE_SCATTER, b, self.size)
        slot, emulate = self._choose(_REDUCE_SCATTER, b.dtype, op, b.nbytes, backend,
                                     b.device)
        o = out_buffer(_REDUCE_SCATTER, out, b, with_rows(shape, shape[0] // self.size),
                       self.size)
        finish = None
        if emulate:
            op = _SUM
            finish = self._avg_finish(o.obj)
        return self._submit(_REDUCE_SCATTER, slot, slot.backend.start_reduce_scatter,
                            (slot.group, b, o, op), b.ranges, o.ranges, o.obj, b.nbytes,
                            after, finish, b.obj, name=name)

    def alltoall(
        self, buf: Any, out: Any = None, *, backend: str | None = None,
        after: Sequence[CommFuture] = (), name: str | None = None,
    ) -> CommFuture:
        """Chunk j of this rank's ``buf`` (along dim 0) goes to rank j; resolves to ``out``."""
        b = as_buffer(buf, "buf")
        shape = split_shape(_ALLTOALL, b, self.size)
        slot, _ = self._choose(_ALLTOALL, b.dtype, None, b.nbytes, backend, b.device)
        o = out_buffer(_ALLTOALL, out, b, shape, self.size)
        return self._submit(_ALLTOALL, slot, slot.backend.start_alltoall, (slot.group, b, o),
                            b.ranges, o.ranges, o.obj, b.nbytes, after, hold=b.obj, name=name)

    def alltoallv(
        self,
        buf: Any,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
        out: Any = None,
        *,
        backend: str | None = None,
        after: Sequence[CommFuture] = (),
        name: str | None = None,
    ) -> CommFuture:
        """Rows ``send_counts[j]`` of ``buf`` (in order along dim 0) go to rank j.

        ``recv_counts[i]`` is how many rows arrive from rank i; when None, the counts are
        exchanged first (an operation of its own, which this one depends on). Resolves to
        ``out``, whose dim 0 is ``sum(recv_counts)``. Returns at once in every case: where
        ``backend="auto"`` picks by the agreed total size (a tuning table that splits
        alltoallv by size), the members agree on it in that same exchange.
        """
        b = as_buffer(buf, "buf")
        if not b.shape:
            raise ValueError("alltoallv splits dim 0, but buf is 0-dimensional; pass "
                             "buf.reshape(-1)")
        send = check_counts("send_counts", send_counts, self.size)
        if sum(send) != b.shape[0]:
            raise ValueError(
                f"send_counts sum to {sum(send)} but buf has {b.shape[0]} rows along dim 0; "
                "they must be equal"
            )
        tail = tuple(b.shape[1:])
        recv = None
        if recv_counts is not None:
            recv = check_counts("recv_counts", recv_counts, self.size)
            o: Buffer | None = out_buffer(OpKind.ALLTOALLV, out, b, (sum(recv), *tail),
                                          self.size)
        elif out is not None:
            o = out_buffer(OpKind.ALLTOALLV, out, b, None, self.size)
            if tuple(o.shape[1:]) != tail:
                raise ValueError(f"out has shape {tuple(o.shape)}; alltoallv of buf with "
                                 f"shape {tuple(b.shape)} needs (sum(recv_counts), *{tail})")
        else:
            o = None
        choice = self._decide(OpKind.ALLTOALLV, b.dtype, None, backend, b.device)
        writes = o.ranges if o is not None else _NO_RANGES
        if type(choice) is not tuple:  # routed by the agreed total, which the exchange gives
            router = cast("Router", choice)
            if name is not None:
                raise UnsupportedOperationError(
                    f"named alltoallv {name!r}: backend='auto' picks its backend by the total "
                    f"size the members agree on (the tuning table splits alltoallv by size), "
                    f"which a named operation cannot wait for; pass recv_counts, or backend=..."
                )
            plan = Exchanged(self, b, send, tail, backend, router, given=recv)
            lanes = tuple({id(s.lane): s.lane for s, _ in router.choices}.values())
            return self._submit(OpKind.ALLTOALLV, router.choices[0][0], plan.start,
                                (None, b, send, o, recv),  # the group, once routed
                                b.ranges, writes, None, b.nbytes, [*after, plan.exchange],
                                plan.finish, b.obj, (lanes, plan.choose), name=name)
        slot = choice[0]
        # A backend that ends the process on counts that do not fit gets them checked first.
        to_check = slot.backend.capabilities.aborts_on_mismatch
        if recv is not None and o is not None and not to_check:
            return self._submit(OpKind.ALLTOALLV, slot, slot.backend.start_alltoallv,
                                (slot.group, b, send, o, recv), b.ranges, writes, o.obj,
                                b.nbytes, after, hold=b.obj, name=name)
        if name is not None:  # (before the exchange, which takes a name made from it)
            check_name(name)
        plan = Exchanged(self, b, send, tail, backend, None, name, recv)
        plan.backend = slot.backend
        return self._submit(OpKind.ALLTOALLV, slot, plan.start, (slot.group, b, send, o, recv),
                            b.ranges, writes, None, b.nbytes, [*after, plan.exchange],
                            plan.finish, b.obj, name=name)

    def barrier(
        self, *, backend: str | None = None, after: Sequence[CommFuture] = (),
        name: str | None = None,
    ) -> CommFuture:
        """Complete once every member has reached its barrier; resolves to None."""
        slot, _ = self._choose(OpKind.BARRIER, None, None, 0, backend, None)
        return self._submit(OpKind.BARRIER, slot, slot.backend.start_barrier, (slot.group,),
                            _NO_RANGES, _NO_RANGES, None, 0, after, name=name)

    # -- sub-communicators and lifetime --------------------------------------------------

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A sub-communicator of the members that pass the same ``color``, on every backend.

        Every member must call it (collective). ``color=None`` opts out and returns None (like
        MPI_UNDEFINED). Ranks in the new communicator are ordered by ``key`` (default: the
        rank here), ties by rank here.
        """
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"color={color!r} must be a non-negative int or None")
        if key is None:
            key = self.rank
        if not isinstance(key, (int, np.integer)):
            raise TypeError(f"key must be an int, got {key!r}")
        mine = np.array([-1 if color is None else int(color), int(key)], dtype=np.int64)
        table = self.allgather(mine).wait().reshape(self.size, 2)
        self._splits = n = self._splits + 1
        if color is None:
            return None
        members = sorted(
            (r for r in range(self.size) if table[r, 0] == color), key=lambda r: (table[r, 1], r)
        )
        return self._runtime.make_communicator(self, f"{self.name}.{n}c{color}", members)

    def shrink(self) -> Communicator:
        """A communicator of this one's members whose processes are alive, on every backend
        that can make a group once members are gone (after `PeerLostError`:
        docs/reliability.md, "Going on"). Collective over the live members, which agree on
        who is alive even when another dies meanwhile; ranks keep this one's order. This one
        stays broken. A backend that cannot (MPICH's MPI) is left out, with a RuntimeWarning
        saying so; an operation named for it then raises BackendUnavailableError.

        Raises:
            BackendUnavailableError: no backend that reaches host memory would be left.
            MCRDLError: a live member did not call it within the bootstrap's timeout (under
                a launcher that does not tell of deaths, a dead one), or could not make its
                groups.
        """
        return self._runtime.shrink_communicator(self)

    def log_summary(self) -> str:
        """The comms log's summary (``init(log=True)`` or ``MCRDL_LOG=1``): per (op, backend,
        size bucket), the count, total and mean latency, p50, p99, algbw and busbw
        (nccl-tests' definitions) over every member, and the slowest member. Collective: every
        member calls it (it gathers through the bootstrap store, not this communicator, so it
        works after a failure too). Covers this runtime's operations on every communicator.

        Raises:
            MCRDLError: the log is off.
        """
        text = self._runtime.log_summary(self)
        return text if text is not None else ""

    def log_records(self) -> list[dict[str, Any]]:
        """This rank's comms log so far (``init(log=True)`` or ``MCRDL_LOG=1``): per finished
        operation of this runtime, its op, backend, lane, communicator, dtype, bytes, its
        submit, issue and completion times (seconds, this rank's clock), latency_us (issue
        to completion), algbw and busbw (GB/s, nccl-tests' definitions). Not collective.

        Raises:
            MCRDLError: the log is off.
        """
        return self._runtime.log_records()

    def dump_flight_recorder(self, path: str | None = None) -> None:
        """Write this rank's flight recorder now: per lane, the last finished operations, the
        unfinished ones with their positions, and what this rank's threads wait for. To
        ``path`` (``{rank}`` is replaced by the rank), or to ``MCRDL_FLIGHT_RECORDER``'s
        destination; as one JSON line when the path ends in ``.json``
        (``python -m mcrdl trace explain`` reads every rank's), as text otherwise. Not
        collective. SIGUSR2 does the same from outside."""
        self._runtime.dump_flight_recorder(path)

    def close(self) -> None:
        """Wait for this communicator's operations, then release its backend groups.

        Closing the world communicator finalizes the runtime. Idempotent.
        """
        if self._closed:
            return
        if self is self._runtime.world:
            self._runtime.finalize()
            return
        self._runtime.close_communicator(self)
        self._mark_closed()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        except MCRDLError:
            if exc[0] is None:
                raise
