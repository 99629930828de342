"""alltoallv's exchange: the receive counts and the agreed total size, as an operation of its own.

An alltoallv whose receive counts are not given, or whose backend ``auto`` picks by the total
size of the exchange (a tuning table that splits alltoallv by size), needs something from the
peers before it can start. That exchange is a small collective submitted first; the data
exchange depends on it like on any other operation, so submitting never blocks and the
exchange is recorded and replayed with the rest:

- only the counts missing: an alltoall of the send counts (each member learns what arrives);
- the size deciding the backend: an allgather of every member's send counts, which gives both
  the counts and the total (rule 4 of docs/design.md: never a per-rank size). The data exchange is
  then routed (``Engine.submit_routed``): it holds its place in every lane it may go to until
  the total is known;
- the counts given, on a backend that ends the process where they do not fit (gloo,
  ``Capabilities.aborts_on_mismatch``), or routed by the size: an allgather of every member's
  send and receive counts (which gives the total too), which every member checks alike
  before the data exchange starts; counts that do not fit fail it with DesyncError on every
  member, naming them.

Waiting for the exchange inside ``alltoallv()`` was rejected: it broke "every operation
returns a future at once" and stalled an asyncio loop for the exchange's round trip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..core._buffers import Buffer, new_buffer
from ..core._errors import DesyncError
from ..core._types import DType, OpKind

if TYPE_CHECKING:
    from ..backends import Backend
    from ..engine import CommFuture
    from ._communicator import Communicator
    from ._select import Router

__all__ = ["Exchanged"]

_NONE: tuple[tuple[int, int], ...] = ()


class Exchanged:
    """The data half of one alltoallv that waits for an exchange (see the module docstring).

    Invariants: ``exchange`` is the exchange's future; ``backend`` is set once the data
    exchange's backend is known (at once, or when it is routed); ``out`` is the output's
    object once the data exchange has started.
    """

    __slots__ = ("exchange", "rank", "tail", "row_bytes", "router", "given", "where", "backend",
                 "counts", "out")

    def __init__(self, comm: Communicator, buf: Buffer, send: tuple[int, ...],
                 tail: tuple[int, ...], backend: str | None, router: Router | None,
                 name: str | None = None, given: tuple[int, ...] | None = None) -> None:
        size = comm.size
        self.rank = comm.rank
        self.tail = tail
        self.row_bytes = buf.row_elems() * buf.obj.itemsize
        self.router = router
        self.given = given
        self.where = f"alltoallv on communicator {comm.name}"
        self.backend: Backend | None = None
        self.out: Any = None
        mine: np.ndarray[Any, np.dtype[np.int64]] = np.asarray(send, dtype=np.int64)
        self.counts: np.ndarray[Any, np.dtype[np.int64]]
        if given is not None:  # to check: everybody's send and receive counts, a row each
            mine = np.concatenate([mine, np.asarray(given, dtype=np.int64)]).reshape(1, -1)
            self.counts = np.empty((size, 2 * size), dtype=np.int64)
            slot, _ = comm._choose(OpKind.ALLGATHER, DType.INT64, None, 16 * size * size, None,
                                   "cpu")
            start, nbytes = slot.backend.start_allgather, mine.nbytes
            kind = OpKind.ALLGATHER
        elif router is None:  # the counts only: on the data's own backend where one was named
            # and it reaches host memory (the counts are a host array)
            if (backend is not None
                    and "cpu" not in comm._slots[backend].backend.capabilities.devices):
                backend = None
            self.counts = np.empty(size, dtype=np.int64)
            slot, _ = comm._choose(OpKind.ALLTOALL, DType.INT64, None, mine.nbytes, backend, "cpu")
            start, nbytes = slot.backend.start_alltoall, mine.nbytes
            kind = OpKind.ALLTOALL
        else:  # counts and total: everybody's send counts, a row per member
            mine = mine.reshape(1, size)
            self.counts = np.empty((size, size), dtype=np.int64)
            slot, _ = comm._choose(OpKind.ALLGATHER, DType.INT64, None, 8 * size * size, None,
                                   "cpu")
            start, nbytes = slot.backend.start_allgather, mine.nbytes
            kind = OpKind.ALLGATHER
        self.exchange = comm._submit(
            kind, slot, start,
            (slot.group, new_buffer(mine, False, DType.INT64),
             new_buffer(self.counts, False, DType.INT64)),
            _NONE, _NONE, self.counts, nbytes, (), hold=mine,
            name=None if name is None else f"{name}#counts")

    def recv_counts(self) -> tuple[int, ...]:
        """The rows that arrive from each member, once the exchange has finished; where they
        were given, the given ones, once every member's are found to fit (DesyncError
        otherwise, alike on every member: each checks the same table)."""
        if self.given is not None:
            size = self.counts.shape[0]
            sends, recvs = self.counts[:, :size], self.counts[:, size:]
            for src in range(size):
                for dst in range(size):
                    if sends[src, dst] != recvs[dst, src]:
                        raise DesyncError(
                            f"{self.where}: rank {src} sends {sends[src, dst]} rows to rank "
                            f"{dst}, which expects {recvs[dst, src]} from it (recv_counts); "
                            f"members must agree on every count")
            return self.given
        counts = self.counts if self.router is None else self.counts[:, self.rank]
        return tuple(int(c) for c in counts)

    def choose(self, fut: CommFuture) -> None:
        """Route the data exchange by the agreed total (``Engine.submit_routed``)."""
        size = self.counts.shape[0]
        total = int(self.counts[:, :size].sum()) * self.row_bytes
        slot, _ = self.router.pick(total)  # type: ignore[union-attr]
        self.backend = slot.backend
        fut.lane = slot.lane
        fut.args = (slot.group, *fut.args[1:])  # type: ignore[index]

    def start(self, group: Any, buf: Buffer, send: tuple[int, ...], out: Buffer | None,
              recv: tuple[int, ...] | None) -> Any:
        """Start the data exchange: the counts are known now; allocate ``out`` if need be."""
        if recv is None or self.given is not None:
            recv = self.recv_counts()
        rows = sum(recv)
        if out is None:
            out = new_buffer(buf.empty((rows, *self.tail)), buf.is_torch, buf.dtype, buf.device)
        elif out.obj.shape[0] != rows:
            raise ValueError(f"out has {out.obj.shape[0]} rows but the peers send {rows} "
                             f"(recv_counts {list(recv)})")
        self.out = out.obj
        return self.backend.start_alltoallv(group, buf, send, out, recv)  # type: ignore[union-attr]

    def finish(self, fut: CommFuture) -> None:
        """The data exchange resolves to its output (allocated at start, if not given)."""
        fut._result = self.out
