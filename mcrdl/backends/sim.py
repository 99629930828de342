"""The sim backend: simulated ranks in one process, for checking the engine's guarantees.

A ``SimBackend`` is one rank's view of a simulated transport inside a ``mcrdl.testing.SimWorld``
(which makes them; the registry knows the name so that it reads like any backend). It moves
real data (numpy) and declares one of four matching semantics:

- ``"mpi"``: nonblocking starts, independent progress; the k-th collective a member issues on
  a group matches every other member's k-th; an operation finishes once every member has
  issued it (after a delay the world draws from its seed).
- ``"windowed"``: as ``"mpi"``, with one collective per lane in flight at a time (the engine
  issues the next when one finishes: ``Capabilities.issue_window``), as the real MPI backend.
- ``"nccl"``: as ``"mpi"``, but each rank executes a stream's operations in order: an issued
  collective occupies its stream until every member has issued it, and the operations behind
  it wait. A stream is the lane (one per group), or one per backend with ``stream="backend"``
  (what a framework with one communication stream per device does).
- ``"blocking"``: a start does not return until every peer has arrived and the operation has
  run (the runtime gives such a backend a thread per lane).
- ``"stream"``: a GPU backend on the world's simulated device (``mcrdl.testing._device``):
  buffers on the device only, each group's operations queued on a stream of its own, where an
  operation occupies the stream until every member's has reached the head of theirs (NCCL's
  kernels), and the engine orders it by events (``Capabilities.stream_ordered``).

In a world with a device, the other semantics reach its memory too (as a CUDA-aware MPI does):
the engine then starts their operations only once the device work they depend on has run.
A backend the world names ``staged`` does not (the runtime stages it through host copies),
and one it names ``direct`` reaches it for every operation but its reductions, which it runs
in host memory (``host_only``), as a CUDA-aware MPI's half-precision reductions: started on
device buffers, a reduction fails.

Inputs are read and outputs written when an operation *executes* (when it finishes), not when
it is issued, so an engine that lets a conflicting operation run in between produces a wrong
result. Members that issue different collectives at the same position, or unmatched
point-to-point signatures, are recorded as a mismatch at once (a real MPI would hang or
corrupt data).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core._buffers import Buffer
from ..core._errors import BackendError, BackendUnavailableError
from ..core._types import REDUCING, DType, OpKind, ReduceOp
from ._contract import Backend, Capabilities, Request

__all__ = ["SEMANTICS", "SimBackend", "SimGroup", "SimOp", "sim_capabilities"]

SEMANTICS = ("mpi", "windowed", "nccl", "blocking", "stream")

_NUMERIC = frozenset(DType) - {DType.BFLOAT16}


def sim_capabilities(semantics: str, device: bool = False) -> Capabilities:
    """What a simulated backend of ``semantics`` can do (everything numpy can, except AVG),
    ``device``: in a world with a simulated device."""
    ordered = _NUMERIC - {DType.COMPLEX64, DType.COMPLEX128}
    integral = frozenset(d for d in _NUMERIC if not d.is_floating)
    return Capabilities(
        ops=frozenset(OpKind),
        dtypes=frozenset(_NUMERIC),
        reductions={ReduceOp.SUM: _NUMERIC, ReduceOp.PROD: _NUMERIC,
                    ReduceOp.MIN: ordered, ReduceOp.MAX: ordered, ReduceOp.BAND: integral,
                    ReduceOp.BOR: integral, ReduceOp.BXOR: integral},
        devices=(frozenset({"simgpu"}) if semantics == "stream"
                 else frozenset({"cpu", "simgpu"}) if device else frozenset({"cpu"})),
        stream_ordered=semantics == "stream",
        cancel=semantics == "stream",
        in_order=semantics in ("nccl", "stream"),
        blocking_calls=semantics == "blocking",
        issue_window=1 if semantics == "windowed" else 0,
        regroups_after_loss=True,  # (a simulated group is made by each member alone)
    )


_BITWISE = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
            ReduceOp.BXOR: np.bitwise_xor}


def reduce_stack(stack: np.ndarray, op: ReduceOp) -> np.ndarray:
    """Members' buffers (along axis 0) reduced with mcrdl's semantics, in rank order."""
    bitwise = _BITWISE.get(op)
    if bitwise is not None:
        return np.asarray(bitwise.reduce(stack, axis=0))
    if stack.dtype == np.bool_:
        either = stack.any(axis=0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(axis=0)
        return np.asarray(either)
    with np.errstate(over="ignore"):
        if op is ReduceOp.SUM:
            return np.asarray(np.add.reduce(stack, axis=0, dtype=stack.dtype))
        if op is ReduceOp.PROD:
            return np.asarray(np.multiply.reduce(stack, axis=0, dtype=stack.dtype))
    if op is ReduceOp.MIN:
        return np.asarray(stack.min(axis=0))
    if op is ReduceOp.MAX:
        return np.asarray(stack.max(axis=0))
    raise ValueError(f"the sim backend reduces natively with SUM, PROD, MIN, MAX, BAND, BOR, "
                     f"BXOR; got {op}")


@dataclass(eq=False)
class SimGroup:
    """One communicator as one rank's SimBackend sees it."""

    gid: str
    members: tuple[int, ...]  # world ranks, in group rank order
    rank: int
    size: int


class SimOp:
    """One collective (or one send/recv pair) across its members.

    Invariants: ``args[r]`` holds member r's start arguments once it has arrived;
    ``ready_at`` is set once every member has arrived (the step at which it may execute);
    ``executed`` once its data has moved.
    """

    __slots__ = ("kind", "gid", "backend", "index", "signature", "members", "args", "ready_at",
                 "executed", "seqs", "heads", "on_streams", "tag")

    def __init__(self, kind: str, gid: str, backend: str, index: int, signature: tuple[Any, ...],
                 members: tuple[int, ...]) -> None:
        self.kind = kind
        self.gid = gid
        self.backend = backend
        self.index = index
        self.signature = signature
        self.members = members
        self.args: dict[int, tuple[Any, ...]] = {}
        self.ready_at: int | None = None
        self.executed = False
        self.seqs: dict[int, int] = {}
        #: Stream semantics: the members whose operation has reached the head of its stream.
        self.heads: set[int] = set()
        self.on_streams = False
        #: A message's tag (``members`` are then its sender and its receiver); None for a
        #: collective.
        self.tag: int | None = None

    def missing(self) -> list[int]:
        """World ranks that have not issued this operation yet."""
        return [m for m in self.members if m not in self.args]

    def describe(self) -> str:
        """What it is and, if unfinished, what it waits for: ``mpi:world allreduce #3:
        ranks [2] have not issued it``, ``gloo:world message #1 from rank 0 to rank 2, tag
        5: rank 2 has not posted its receive``."""
        if self.tag is None:
            head = f"{self.backend}:{self.gid} {self.kind} #{self.index}"
            missing = self.missing()
            why = (f"ranks {missing} have not issued it" if missing
                   else "waits for earlier operations on a member's stream")
        else:
            src, dst = self.members
            head = (f"{self.backend}:{self.gid} message #{self.index} from rank {src} to rank "
                    f"{dst}, tag {self.tag}")
            if src not in self.args:
                why = f"rank {src} has not posted its send"
            elif dst not in self.args:
                why = f"rank {dst} has not posted its receive"
            else:
                why = "waits for earlier operations on a member's stream"
        return f"{head}: {why}"

    def missing_heads(self) -> list[int]:
        """World ranks whose stream has not reached this operation yet (stream semantics)."""
        return [m for m in self.members if m not in self.heads]

    def __repr__(self) -> str:
        return f"<SimOp {self.backend}:{self.gid} {self.kind}#{self.index}>"


class _Handle:
    """A member's request: its operation, the member's rank, whether it is to report a
    failure once the operation has run (an injected fault), and the stream it was queued on
    (stream semantics)."""

    __slots__ = ("op", "rank", "failing", "stream")

    def __init__(self, op: SimOp, rank: int, failing: bool, stream: Any = None) -> None:
        self.op = op
        self.rank = rank
        self.failing = failing
        self.stream = stream


def _injected(rank: int) -> BackendError:
    return BackendError(f"sim: a failure injected on rank {rank}")


class SimBackend(Backend):
    """One rank's simulated transport (see the module docstring)."""

    name = "sim"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def __init__(self, bootstrap: Any) -> None:
        world = getattr(bootstrap, "sim_world", None)
        if world is None:
            raise BackendUnavailableError(
                "sim backends are made by mcrdl.testing.SimWorld, not by init()"
            )
        self.sim = world
        self.world_rank: int = bootstrap.rank
        self.name = bootstrap.sim_name  # type: ignore[misc]
        self.semantics: str = bootstrap.sim_semantics
        if self.semantics not in SEMANTICS:
            raise ValueError(f"sim semantics {self.semantics!r}; choose one of {SEMANTICS}")
        #: The rank's simulated device, in a world that has one.
        self.device = world.devices[self.world_rank] if world.devices else None
        self.capabilities = sim_capabilities(self.semantics, self.device is not None)
        if self.semantics == "stream" and self.device is None:
            raise ValueError("sim semantics 'stream' needs a world with a device")
        self._streams: dict[str, Any] = {}
        self._world_group = SimGroup("world", tuple(range(bootstrap.size)), bootstrap.rank,
                                     bootstrap.size)

    def world(self) -> SimGroup:
        return self._world_group

    def create_group(self, parent: SimGroup, members: Sequence[int], tag: str) -> SimGroup:
        world_members = tuple(parent.members[m] for m in members)
        return SimGroup(tag, world_members, world_members.index(self.world_rank),
                        len(world_members))

    def regroup(self, parent: SimGroup, members: Sequence[int], tag: str,
                store: Any) -> SimGroup:
        return self.create_group(parent, members, tag)

    def free_group(self, group: SimGroup) -> None:
        pass

    def stream(self, group: SimGroup) -> Any:
        """The group's stream on the rank's device (stream semantics)."""
        stream = self._streams.get(group.gid)
        if stream is None:
            stream = self._streams[group.gid] = self.device.new_stream()
        return stream

    # -- operations ----------------------------------------------------------------------

    def host_only(self, op: OpKind, args: tuple[Any, ...]) -> bool:
        # A world's ``direct`` backend (the only kind that declares ``direct``) reduces in
        # host memory, as a CUDA-aware MPI's half-precision reductions do.
        return bool(self.capabilities.direct) and op in REDUCING

    def _collective(self, group: SimGroup, kind: str, signature: tuple[Any, ...],
                    args: tuple[Any, ...]) -> Request:
        if self.host_only(OpKind(kind), args) and any(
                type(a) is Buffer and a.device != "cpu" for a in args):
            raise RuntimeError(f"sim: {self.name} reduces in host memory; {kind} was started "
                               f"on device buffers")
        fault = self._fault(args)
        op = self.sim.arrive(self, group, kind, signature, args)
        return self._started(op, fault, group)

    def _fault(self, args: tuple[Any, ...]) -> str | None:
        """The fault injected on this operation's buffers (``"error"``), if any; an
        injected ``"start"`` fault raises here, before the operation reaches the peers."""
        fault: str | None = self.sim.fault(args)
        if fault == "start":
            raise RuntimeError(f"sim: a start failure injected on rank {self.world_rank}")
        return fault

    def _started(self, op: SimOp, fault: str | None, group: SimGroup) -> Request:
        if self.semantics == "stream":  # queued on the group's stream; it runs from there
            op.on_streams = True
            stream = self.stream(group)
            stream.items.append(("coll", op))
            return _Handle(op, self.world_rank, fault == "error", stream)
        if self.semantics == "blocking":
            self.sim.block_until_executed(op, self.world_rank)
            if fault == "error":
                raise _injected(self.world_rank)
            return None
        return _Handle(op, self.world_rank, fault == "error")

    @staticmethod
    def _sig(buf: Buffer | None) -> tuple[Any, ...]:
        return (None, 0) if buf is None else (buf.dtype.value, buf.nbytes)

    def start_send(self, group: SimGroup, buf: Buffer, dst: int, tag: int) -> Request:
        fault = self._fault((buf,))
        op = self.sim.arrive_p2p(self, group, "send", group.members[dst], tag, buf)
        return self._started(op, fault, group)

    def start_recv(self, group: SimGroup, buf: Buffer, src: int, tag: int) -> Request:
        fault = self._fault((buf,))
        op = self.sim.arrive_p2p(self, group, "recv", group.members[src], tag, buf)
        return self._started(op, fault, group)

    def start_broadcast(self, group: SimGroup, buf: Buffer, root: int) -> Request:
        return self._collective(group, "broadcast", (root, *self._sig(buf)), (buf, root))

    def start_reduce(self, group: SimGroup, buf: Buffer, root: int, op: ReduceOp) -> Request:
        return self._collective(group, "reduce", (root, op, *self._sig(buf)), (buf, root, op))

    def start_allreduce(self, group: SimGroup, buf: Buffer, op: ReduceOp) -> Request:
        return self._collective(group, "allreduce", (op, *self._sig(buf)), (buf, op))

    def start_gather(self, group: SimGroup, buf: Buffer, out: Buffer | None, root: int) -> Request:
        return self._collective(group, "gather", (root, *self._sig(buf)), (buf, out, root))

    def start_allgather(self, group: SimGroup, buf: Buffer, out: Buffer) -> Request:
        return self._collective(group, "allgather", self._sig(buf), (buf, out))

    def start_scatter(self, group: SimGroup, buf: Buffer | None, out: Buffer, root: int) -> Request:
        return self._collective(group, "scatter", (root, *self._sig(out)), (buf, out, root))

    def start_reduce_scatter(self, group: SimGroup, buf: Buffer, out: Buffer,
                             op: ReduceOp) -> Request:
        return self._collective(group, "reduce_scatter", (op, *self._sig(buf)), (buf, out, op))

    def start_alltoall(self, group: SimGroup, buf: Buffer, out: Buffer) -> Request:
        return self._collective(group, "alltoall", self._sig(buf), (buf, out))

    def start_alltoallv(self, group: SimGroup, buf: Buffer, send_counts: Sequence[int],
                        out: Buffer, recv_counts: Sequence[int]) -> Request:
        return self._collective(group, "alltoallv", (buf.dtype.value,),
                                (buf, tuple(send_counts), out, tuple(recv_counts)))

    def start_barrier(self, group: SimGroup) -> Request:
        return self._collective(group, "barrier", (), ())

    # -- completion ----------------------------------------------------------------------

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        sim = self.sim
        out: list[tuple[int, BaseException | None]] = []
        for i, handle in enumerate(requests):
            if handle.op.executed if handle.op.on_streams else sim.try_execute(handle.op):
                out.append((i, _injected(handle.rank) if handle.failing else None))
        return out

    def cancel(self, request: Request) -> bool:
        """Stream semantics: take the operation off its stream unless it has run (NCCL's
        abort ends the kernels of a communicator whose peers will not come)."""
        op = request.op
        if request.stream is None or op.executed:
            return False
        request.stream.items.remove(("coll", op))
        op.heads.discard(self.world_rank)
        self.sim.note_progress()
        return True

    def describe_wait(self, request: Request) -> str | None:
        """Which peers the operation still waits for (the timeout message names them)."""
        op = request.op
        return op.describe().split(": ", 1)[1] if op.missing() else None
