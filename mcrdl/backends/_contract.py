"""The backend contract: one ABC that every transport implements, and its capabilities as data.

A backend *starts* operations and returns a request that the engine can *test* without
blocking. It never waits: all waiting, ordering and dependency tracking is the engine's
(``mcrdl.engine``). Everything the engine and the front need to know about a backend is in
this module; a concrete backend's docstring only adds its quirks.

Lifecycle: the runtime constructs each backend once per process with a `Rendezvous`, then asks
for the world group and for sub-groups as communicators are split. Operations arrive as
``start_<op>(group, ...)`` calls, in the order the engine issues them; ``test`` reports which
requests have finished. All calls into one backend come from one thread at a time (the engine's
lock), so a backend may use libraries initialized for serialized threading.

Buffers are `mcrdl.core._buffers.Buffer` objects, already checked for contiguity, device and dtype
against ``capabilities``; a backend asks them for the view it speaks (``numpy()``,
``torch()``). Shapes follow torch's dim-0 convention: gather and allgather concatenate along dim
0; scatter, reduce_scatter and alltoall split dim 0 into ``group.size`` equal chunks; alltoallv
splits it by counts (in dim-0 rows).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from ctypes import memmove
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..core._errors import BackendUnavailableError, UnsupportedOperationError
from ..core._types import DType, OpKind, ReduceOp

if TYPE_CHECKING:
    from ..core._buffers import Buffer

__all__ = ["Backend", "Capabilities", "Group", "Rendezvous", "Request"]

#: What ``start_*`` returns: opaque to everybody but the backend that made it. ``None`` means the
#: operation finished during the start call (a size-1 group, an empty message).
Request = Any


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data the front and the selector consult.

    Attributes:
        ops: operations it starts.
        dtypes: element types it carries (moves) in every operation of ``ops``.
        reductions: for each ReduceOp it performs natively, the dtypes it reduces correctly.
            AVG missing here is not a refusal: the engine runs SUM and divides.
        devices: the kinds of device its buffers may live on (``"cpu"``, ``"cuda"``; see
            `mcrdl.backends._device`). A backend that lists a device kind besides ``"cpu"``
            has a ``device`` (the `Device` of that kind it reaches), or reaches it staged.
        staged: the device kinds among ``devices`` it reaches only through host copies that
            the runtime makes around each operation (`mcrdl.backends._staging`): a host
            backend (MPI without CUDA support, gloo) on device buffers.
        direct: device kinds, not among ``devices``, whose memory this host backend reads and
            writes in place for every operation but those ``Backend.host_only`` names (a
            CUDA-aware MPI, whose half-precision reductions run in a host callback). The
            runtime's staging adapter hands it those operations as they are and stages the
            others; once wrapped, ``devices`` lists these kinds and ``staged`` does not.
        cancel: whether an issued request can be cancelled.
        stream_ordered: whether it orders work on a device stream (GPU backends): each of its
            groups has a stream (``Backend.stream``), where ``start_*`` queues the operation
            so that work queued there after the call runs after the operation; the engine
            then orders it by events, never by host waits.
        in_order: whether a group's issued work runs one operation at a time, in issue order
            (a device stream, a worker thread): nothing behind an operation that never
            finishes ever runs. Stream-ordered backends set it too.
        self_progressing: whether it completes work on threads of its own (gloo), so that a
            poller must yield the CPU to it instead of spinning; False where the caller's polls
            are what moves the data (MPI).
        blocking_wait: whether ``block()`` can wait for one request without the engine's
            lock, which beats polling when that request is all that is in flight.
        waits_in_threads: whether some of its operations are seen to finish only by blocking
            in them, so that each one in flight holds a thread of this process
            (``Backend.thread_held``): one that no peer matches holds it until the peer process
            exits and its connections close.
        blocking_calls: whether its ``start_*`` calls block until the peers arrive; the
            runtime then runs each group's calls on a thread of its own
            (``backends._threaded``), since the engine never blocks in a backend.
        issue_window: how many of a lane's collectives may be in flight at once (0: no
            limit); the next one is issued when one finishes. Sends and receives are never
            held back or counted: a receive waiting for a send behind it would never end.
        aborts_on_mismatch: whether members whose alltoallv counts do not fit one another
            end the process (gloo: an exception in its own thread): the front then checks
            the counts across the members before the data exchange starts.
        any_source: whether it receives from any source (``start_recv_any``), matched by
            the backend in the order receives were started; ``source`` then says whom its
            message came from.
        regroups_after_loss: whether ``create_group`` reaches none but the new group's
            members (gloo: they meet through the store), so that a group of the survivors can
            be made from a parent some of whose members' processes are gone
            (`Communicator.shrink`). MPI's reaches the parent's processes through the
            launcher, which fails once one of them is gone (MPICH; Open MPI's ULFM shrinks
            instead).
    """

    ops: frozenset[OpKind]
    dtypes: frozenset[DType]
    reductions: Mapping[ReduceOp, frozenset[DType]] = field(default_factory=dict)
    devices: frozenset[str] = frozenset({"cpu"})
    staged: frozenset[str] = frozenset()
    direct: frozenset[str] = frozenset()
    cancel: bool = False
    stream_ordered: bool = False
    in_order: bool = False
    self_progressing: bool = False
    blocking_wait: bool = False
    waits_in_threads: bool = False
    blocking_calls: bool = False
    issue_window: int = 0
    aborts_on_mismatch: bool = False
    any_source: bool = False
    regroups_after_loss: bool = False

    def can_reduce(self, op: ReduceOp, dtype: DType) -> bool:
        """Whether ``op`` on ``dtype`` is possible, natively or (AVG) as SUM then divide."""
        if op is ReduceOp.AVG and ReduceOp.AVG not in self.reductions:
            return dtype.is_floating and dtype in self.reductions.get(ReduceOp.SUM, ())
        return dtype in self.reductions.get(op, ())


class Group(Protocol):
    """A backend's handle for one communicator: its members' ranks and this process's rank."""

    rank: int
    size: int


class Rendezvous(Protocol):
    """What a backend may ask of the runtime while it comes up (the launcher's view of the job
    that `mcrdl.bootstrap.Bootstrap` gives, or a simulated world's).

    Attributes:
        rank: this process's rank in the world.
        size: the world's size.
        launcher: ``"mpi"``, ``"torchrun"`` or ``"single"``.
        host: the address to bind listening sockets to (loopback when all ranks share a host).
        timeout: seconds a blocking bring-up step may take before it fails.
    """

    rank: int
    size: int
    launcher: str
    host: str
    timeout: float

    def store(self) -> Any:
        """A torch.distributed Store shared by all ranks (created on first use)."""
        ...


class Backend(ABC):
    """One transport behind the engine. Subclasses set ``name`` and ``capabilities``.

    ``group`` arguments are the backend's own `Group` objects (typed ``Any`` here, so that
    each backend can name its own class).

    Invariants:
    - no method blocks waiting for a peer once the backend is up, except group creation, which
      the runtime calls only when every member is known to be making the same call;
    - ``start_*`` either returns a request, returns None (finished already) or raises (the
      operation failed before anything was sent; the engine fails its future with the message).
    """

    name: ClassVar[str]
    capabilities: Capabilities
    #: The accelerator its device buffers are on (`mcrdl.backends._device.Device`); None for
    #: a backend of host buffers only.
    device: Any = None

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this backend can run in this process. Never raises, never initializes."""

    @abstractmethod
    def __init__(self, bootstrap: Rendezvous) -> None:
        """Bring the backend up on the world (collective over all ranks)."""

    @abstractmethod
    def world(self) -> Any:
        """The group of all ranks."""

    @abstractmethod
    def create_group(self, parent: Any, members: Sequence[int], tag: str) -> Any:
        """A group of ``members`` (ranks of ``parent``, in the new group's rank order).

        Called by exactly the members, all with the same arguments; ``tag`` is unique per
        communicator in the runtime, so that concurrent creations cannot match each other.
        """

    def regroup(self, parent: Any, members: Sequence[int], tag: str, store: Any) -> Any:
        """As ``create_group``, where some of ``parent``'s other processes are gone
        (`Communicator.shrink`): only a backend whose members meet through ``store``, a
        store connection of the caller's (``capabilities.regroups_after_loss``), can.

        Raises:
            BackendUnavailableError: this backend cannot (the default).
        """
        raise BackendUnavailableError(
            f"backend {self.name} cannot make a group once members of its parent are gone")

    @abstractmethod
    def free_group(self, group: Any) -> None:
        """Release a group created by ``create_group``; no request on it is in flight."""

    # Operations. Each returns a Request (see module docstring for shapes).

    @abstractmethod
    def start_send(self, group: Any, buf: Buffer, dst: int, tag: int) -> Request:
        """Send ``buf`` to rank ``dst`` of ``group``."""

    @abstractmethod
    def start_recv(self, group: Any, buf: Buffer, src: int, tag: int) -> Request:
        """Receive into ``buf`` from rank ``src`` of ``group``."""

    @abstractmethod
    def start_broadcast(self, group: Any, buf: Buffer, root: int) -> Request:
        """Copy ``root``'s ``buf`` into every member's ``buf``."""

    @abstractmethod
    def start_reduce(self, group: Any, buf: Buffer, root: int, op: ReduceOp) -> Request:
        """Reduce every member's ``buf`` into ``root``'s ``buf``; others' ``buf`` stay unchanged."""

    @abstractmethod
    def start_allreduce(self, group: Any, buf: Buffer, op: ReduceOp) -> Request:
        """Reduce every member's ``buf`` into every member's ``buf``."""

    @abstractmethod
    def start_gather(self, group: Any, buf: Buffer, out: Buffer | None, root: int) -> Request:
        """Concatenate members' ``buf`` along dim 0 into ``root``'s ``out`` (None elsewhere)."""

    @abstractmethod
    def start_allgather(self, group: Any, buf: Buffer, out: Buffer) -> Request:
        """Concatenate members' ``buf`` along dim 0 into every member's ``out``."""

    @abstractmethod
    def start_scatter(self, group: Any, buf: Buffer | None, out: Buffer, root: int) -> Request:
        """Split ``root``'s ``buf`` along dim 0; chunk i goes to member i's ``out``."""

    @abstractmethod
    def start_reduce_scatter(self, group: Any, buf: Buffer, out: Buffer, op: ReduceOp) -> Request:
        """Reduce members' ``buf``; chunk i of the result along dim 0 goes to member i's ``out``."""

    @abstractmethod
    def start_alltoall(self, group: Any, buf: Buffer, out: Buffer) -> Request:
        """Chunk j of member i's ``buf`` goes to chunk i of member j's ``out``."""

    @abstractmethod
    def start_alltoallv(
        self,
        group: Any,
        buf: Buffer,
        send_counts: Sequence[int],
        out: Buffer,
        recv_counts: Sequence[int],
    ) -> Request:
        """Like alltoall with ``send_counts[j]`` rows to member j, ``recv_counts[i]`` from i."""

    @abstractmethod
    def start_barrier(self, group: Any) -> Request:
        """Complete once every member has started its barrier."""

    # Completion.

    @abstractmethod
    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        """Which of ``requests`` have finished: ``(index, None)`` or ``(index, error)``.

        Never blocks; one call is also one step of the backend's progress where that matters.
        """

    def test_one(self, request: Request) -> bool:
        """Whether one request has finished; raises its error (a BackendError) if it failed.

        The engine tests a lone request of a backend whose data moves only while it is polled
        this way, many times over, while its caller waits; a backend whose requests test
        cheaper one at a time overrides it.
        """
        done = self.test([request])
        if not done:
            return False
        error = done[0][1]
        if error is not None:
            raise error
        return True

    def block(self, request: Request, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``request`` (``capabilities.blocking_wait`` only),
        or up to the backend's timer resolution where that is longer (gloo: 1 ms).

        Called without the engine's lock, while nothing else is in flight; True if the request
        has finished (``test`` then reports how). Never raises for a slow request.
        """
        return False

    def stream(self, group: Any) -> Any:
        """The stream ``group``'s operations are queued on: one per group, never the legacy
        default stream, for a ``capabilities.stream_ordered`` backend, which must override
        this; None (this default) for every other backend, whose operations are on none."""
        return None

    def host_only(self, op: OpKind, args: tuple[Any, ...]) -> bool:
        """Whether the operation ``op`` (``args``: its start's arguments after the group) needs its device buffers in host memory although this backend
        reaches their kind (``capabilities.direct``): the runtime then stages it. Default:
        never."""
        return False

    def start_recv_any(self, group: Any, buf: Buffer, tag: int) -> Request:
        """Receive into ``buf`` the first message of ``tag`` from any rank of ``group``.
        A backend with ``capabilities.any_source`` overrides it; the others refuse."""
        raise UnsupportedOperationError(f"{self.name} does not receive from any source")

    def source(self, request: Request) -> int:
        """The rank of the group a finished ``start_recv_any`` got its message from (a
        backend with ``capabilities.any_source`` overrides it; the others refuse)."""
        raise UnsupportedOperationError(f"{self.name} does not receive from any source")

    def describe_wait(self, request: Request) -> str | None:
        """What an unfinished request waits for, where the backend knows (e.g. "ranks [2]
        have not issued it"); None where it cannot tell. Timeout messages quote it."""
        return None

    def cancel(self, request: Request) -> bool:
        """Try to cancel an issued request; True if it will not complete. Default: cannot."""
        return False

    def abandon(self, group: Any) -> None:  # noqa: B027 - optional hook
        """``group`` is about to be freed (or the backend closed) while work on it may still
        run, here or at peers: the engine gave up on an operation it could not cancel, or
        the communicator broke. Keep whatever that work needs for the rest of the process,
        so that neither this rank nor its peers block or fail on a torn-down group. Default:
        nothing (the engine keeps the requests and the memory they use)."""

    def thread_held(self, request: Request) -> Any:
        """If ``request`` holds a thread of this process blocked in the backend on its behalf
        (``capabilities.waits_in_threads``), a ``threading.Event`` set once it no longer does;
        otherwise None (the default)."""
        return None

    def copy_host(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy host memory: each ``(dst, src, nbytes)`` of ``copies``, by address (fusion's
        copies into and out of its buffer, `mcrdl.engine._fusion`). The ranges do not
        overlap. Default: one ``memmove`` each; a backend may do them all in one call."""
        for dst, src, nbytes in copies:
            memmove(dst, src, nbytes)

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release everything; the runtime calls it once, after the engine has drained."""
