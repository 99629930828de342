"""Fusion: small named allreduces agreed in one round run as one allreduce (Horovod's idea).

An agreement round (`mcrdl.engine._names`) hands the engine a batch of named operations in an
order every member computed alike. Among them, allreduces of host memory with the same lane,
dtype and reduce op, each of at most ``FUSE_OP_BYTES``, are *fused*, up to the runtime's
``fusion_bytes`` a group (``init(fusion_bytes=...)``, ``MCRDL_FUSION_BYTES``; 1 MiB): the
group's first operation (its *carrier*) copies every member's bytes into one buffer when it
is issued, allreduces that buffer, and copies each member's share back in its finishing
step. The others are issued with the carrier and end with it, done or failed as
it is (`Engine._issue`, `Engine._end_carried`): their peers ran them as this rank did, so a
failure of the carrier in flight fails them without breaking the communicator, as it fails
an operation that ran alone. Each keeps its place in the lane (rule 7 counts positions), its
hazards and its own finishing step (an emulated AVG's division).

Why: a step of 64 allreduces of 4 B costs 64 times the per-operation price of the engine
and the backend, and the fused one costs that price once plus the copies; from 64 KiB a
member on, the copies cost as much as the operations they save (docs/performance-log.md,
"Fusion of small named allreduces; awaiting tasks that finished meanwhile").

Every member must fuse alike, or their backends would see different collectives: the choice
reads only what the signature fixes on every member (operation, dtype, shape, reduce op,
backend, host or device memory: `Communicator._signature`) and the agreed order.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..core._buffers import Buffer, new_buffer
from ._states import ISSUED

if TYPE_CHECKING:
    from ._future import CommFuture

__all__ = ["FUSE_OP_BYTES", "carried", "fuse"]

#: The largest named allreduce fused with others (bytes).
FUSE_OP_BYTES = 32 << 10


def fuse(futs: list[CommFuture], limit: int) -> None:
    """Fuse the small host allreduces among ``futs`` (agreed on, in the agreed order, not
    placed yet), in groups of at most ``limit`` bytes; the others are left as they are."""
    groups: dict[tuple[Any, ...], list[CommFuture]] = {}
    for fut in futs:
        # (an allreduce's nbytes are its buffer's: the size test first, the cheapest refusal)
        if 0 < fut.nbytes <= FUSE_OP_BYTES and fut.kind == "allreduce" and fut.device is None:
            _, buf, op = fut.args  # type: ignore[misc]  # (group, buf, op) until issued
            groups.setdefault((fut.lane, buf.dtype, op), []).append(fut)
    for group in groups.values():
        batch: list[CommFuture] = []
        total = 0
        for fut in group:
            if total + fut.nbytes > limit:
                if len(batch) > 1:
                    _Fused(batch, limit)
                batch, total = [], 0
            batch.append(fut)
            total += fut.nbytes
        if len(batch) > 1:
            _Fused(batch, limit)


def carried(obj: Any) -> list[Any]:
    """The caller's objects whose bytes ``obj``, a fusion buffer as a backend was given it,
    carries ([] for any other object): a simulated world fires a fault injected on a
    member's buffer on its carrier (`mcrdl.testing`)."""
    return [b.obj for _, b in _CARRIED.get(id(obj), ())]


#: id(fusion buffer given to a backend) -> its group's members, while the group runs (its
#: `_Fused` itself is not kept: it holds the spare buffer, whose views live as long as it, and
#: a failed group, which never gets to its finish, would then be kept for good).
_CARRIED: dict[int, list[tuple[CommFuture, Buffer]]] = {}


def _never() -> None:
    raise RuntimeError("a fused operation is issued by its carrier, never on its own")


#: Spare fusion buffers of ``fusion_bytes`` (of the runtime that made them), each with its
#: length in elements and its views by length, by (torch or numpy, dtype): a fresh one costs
#: a page fault per 4 KiB at its first use, more than the copies at 64 KiB a member.
_SPARES: dict[tuple[bool, Any], list[tuple[int, Any, dict[int, Any]]]] = {}
_MAX_SPARES = 2
#: Views a spare keeps (groups of that many lengths in turn reuse theirs).
_MAX_VIEWS = 8


class _Fused:
    """One fused allreduce: the carrier's start and finishing step, and what they copy."""

    __slots__ = ("carrier", "members", "proto", "numel", "limit", "spare", "view", "addr",
                 "start_op", "group", "op", "finish_op")

    def __init__(self, futs: list[CommFuture], limit: int) -> None:
        carrier = futs[0]
        group, buf, op = carrier.args  # type: ignore[misc]
        self.carrier = carrier
        self.members: list[tuple[CommFuture, Buffer]] = []
        nbytes = 0
        for fut in futs:
            member = fut.args[1]  # type: ignore[index]
            self.members.append((fut, member))
            nbytes += member.nbytes
            if fut is not carrier:
                fut.carrier = carrier
                fut.start, fut.args = _never, ()
        self.proto = buf
        self.numel = nbytes // buf.obj.itemsize
        self.limit = limit
        self.spare: Any = None  # (length, whole buffer, views by length) while it runs
        self.view: Any = None
        self.addr = 0
        self.start_op, self.group, self.op = carrier.start, group, op
        self.finish_op = carrier.finish
        carrier.start, carrier.args, carrier.finish = self.start, (), self.finish
        carrier.carried = futs[1:]  # (issued with it, ended with it: Engine._issue)

    def start(self) -> Any:
        """Copy every member's bytes into a fusion buffer, and start its allreduce. (The
        carrier holds the buffer: if it fails, the buffer is not reused, since its backend
        may still write it.)"""
        proto = self.proto
        spares = _SPARES.get((proto.is_torch, proto.obj.dtype))
        spare = spares.pop() if spares else None
        if spare is None or spare[0] < self.numel:  # (made for a smaller fusion_bytes)
            length = max(self.limit // proto.obj.itemsize, self.numel)
            spare = (length, proto.empty((length,)), {})
        self.spare = spare
        _, whole, views = spare
        self.carrier.hold = (self.carrier.hold, whole)
        # The spare's view of the group's length: a step fuses groups of the same lengths
        # every iteration, and slicing a tensor was a large part of a group's start.
        obj = views.get(self.numel)
        if obj is None:
            if len(views) >= _MAX_VIEWS:
                views.clear()
            obj = views[self.numel] = whole[:self.numel]
            weakref.finalize(obj, _CARRIED.pop, id(obj), None)
        _CARRIED[id(obj)] = self.members  # (until it ends: finish, or the view's end)
        self.view = obj
        self.addr = at = obj.data_ptr() if proto.is_torch else obj.ctypes.data
        copies = []
        for _, b in self.members:
            copies.append((at, b.addr, b.nbytes))
            at += b.nbytes
        self.carrier.lane.backend.copy_host(copies)
        return self.start_op(self.group, new_buffer(obj, proto.is_torch, proto.dtype),  # type: ignore[misc]
                             self.op)

    def finish(self, carrier: CommFuture) -> None:
        """Copy each member's share of the result back, then run the carrier's own step."""
        at = self.addr
        copies = []
        for fut, b in self.members:
            if fut._state == ISSUED:  # (the carrier, and what it carries: Engine._issue)
                copies.append((b.addr, at, b.nbytes))
            at += b.nbytes
        carrier.lane.backend.copy_host(copies)
        _CARRIED.pop(id(self.view), None)  # (the members' objects are not kept)
        self.view = None
        proto = self.proto
        spares = _SPARES.setdefault((proto.is_torch, proto.obj.dtype), [])
        if len(spares) < _MAX_SPARES:
            spares.append(self.spare)
        self.spare = None
        if self.finish_op is not None:
            self.finish_op(carrier)
