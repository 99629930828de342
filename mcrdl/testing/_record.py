"""Record what each rank submits in a real step; replay it in the simulated world.

::

    with mcrdl.testing.record(comm, "step-{rank}.json"):   # each rank, real backends
        train_step(comm)                 # saved on leaving the block, even when it raised
    recs = [Recording.load(f"step-{r}.json") for r in range(4)]
    mcrdl.testing.replay_ranks(recs, seeds=range(50))     # one process: many timings

A recording keeps, per operation (read from its descriptor as it is submitted): the kind,
the communicator (name, size, members), the backend ("auto" where it is decided by the agreed
size), the dtype and byte ranges of its buffers, the root, the ReduceOp, a send's or receive's
peer and tag, the name, and the ``after=`` edges; and the rank's order of events: each
submission and each wait (``wait()`` or ``await``), with the asyncio task it came from.

Two replays:

- `replay_ranks`: the recordings of every rank, each replayed on the rank it came from, in
  one simulated world per seed and semantics (`check_step`): sends and receives, names and
  sub-communicators as recorded. Each rank submits in its recorded order; each task waits
  where it waited. What it checks is that this order deadlocks or mismatches under no other
  timing; a recording of a step that hung replays into the same hang, reported with the
  ranks, operations, peers and tags involved.
- `replay`: one rank's recording, on any number of ranks, every rank submitting the same
  sequence (SPMD, as data- and expert-parallel steps are), with backends reassigned per
  seed and the results checked against the sequential reference (so buffer reuse, and with
  it the hazards across backends, is reproduced). A sub-communicator of size k is replayed
  as blocks of k consecutive ranks. Sends and receives are refused there: one rank's view
  lacks its peers' halves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..core._buffers import Buffer
from ..core._types import ReduceOp
from ..engine import ANY_PEER
from ._programs import Program, Region, Step

__all__ = ["Recording", "record", "replay", "replay_ranks"]

_FORMAT = 2


@dataclass
class Recorded:
    """One submitted operation, as recorded (JSON-friendly)."""

    kind: str
    comm: str
    comm_size: int
    backend: str
    dtype: str | None = None
    buf: tuple[int, int] | None = None  # (start, stop) byte range
    out: tuple[int, int] | None = None
    out_fresh: bool = False
    itemsize: int = 0
    row: int = 1
    root: int = 0
    op: str | None = None
    counts: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    members: tuple[int, ...] = ()  # the communicator's members, as world ranks
    peer: int = -1  # a send's or receive's peer (a rank of the communicator)
    tag: int = 0
    name: str | None = None
    recv_counts: tuple[int, ...] | None = None  # an alltoallv's, where given
    exchange: bool = False  # an alltoallv's count exchange (the front makes it again)


@dataclass
class Recording:
    """The operations a rank submitted, in order (see the module docstring)."""

    size: int
    rank: int
    ops: list[Recorded] = field(default_factory=list)
    #: In order: ``["submit", i, task]`` or ``["wait", i, task]`` for operation ``i``;
    #: ``task`` numbers the asyncio tasks by their first event (0: outside any task).
    events: list[list[Any]] = field(default_factory=list)

    def save(self, path: str) -> None:
        """Write the recording as JSON."""
        data = {"format": _FORMAT, "size": self.size, "rank": self.rank,
                "ops": [asdict(op) for op in self.ops], "events": self.events}
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)

    @classmethod
    def load(cls, path: str) -> Recording:
        """Read a recording written by ``save``."""
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format") != _FORMAT:
            raise ValueError(f"{path} is not an mcrdl recording of format {_FORMAT}")
        ops = [Recorded(**{k: tuple(v) if isinstance(v, list) else v  # type: ignore[arg-type]
                           for k, v in op.items()})
               for op in data["ops"]]
        return cls(data["size"], data["rank"], ops, data["events"])

    def to_program(self, size: int | None = None,
                   backends: Mapping[int, str] | None = None) -> Program:
        """The recording as a `Program` for ``size`` ranks (default: the recorded size).

        ``backends`` maps operation indices to another backend name (a replay's assignment).
        """
        return _to_program(self, size or self.size, backends or {})


@contextmanager
def record(comm: Any, path: str | None = None) -> Iterator[Recording]:
    """Record every operation submitted through ``comm``'s runtime inside the block, and
    every wait for one.

    Each operation is read from its descriptor as it is submitted (``Engine.observe``): an
    alltoallv whose counts are exchanged appears as the exchange and the data exchange,
    with the edge between them. ``path`` (``{rank}`` is replaced by the rank): where the
    recording is saved on leaving the block, whether the block ended or raised (a step that
    hung and timed out is recorded up to where it stopped).
    """
    engine = comm.runtime.engine
    rec = Recording(comm.runtime.world.size, comm.runtime.world.rank)
    index: dict[int, int] = {}  # id(future) -> op index
    tasks: dict[int, int] = {}  # id(task) -> its number
    kept: list[Any] = []  # the recorded futures and tasks, so that their ids stay theirs

    def task() -> int:
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no event loop in this thread
            return 0
        if current is None:
            return 0
        if id(current) not in tasks:
            tasks[id(current)] = len(tasks) + 1
            kept.append(current)
        return tasks[id(current)]

    def observe(fut: Any, after: tuple[Any, ...]) -> None:
        if fut.kind == "fingerprint":
            return
        index[id(fut)] = i = len(rec.ops)
        kept.append(fut)
        rec.ops.append(_decode(fut, [index[id(f)] for f in after if id(f) in index]))
        # An alltoallv's data half starts by a method of its exchange (`Exchanged`): mark
        # the exchange, which a replay's alltoallv makes again.
        exchange = getattr(getattr(fut.start, "__self__", None), "exchange", None)
        if exchange is not None and id(exchange) in index:
            rec.ops[index[id(exchange)]].exchange = True
        rec.events.append(["submit", i, task()])

    def waited(fut: Any) -> None:
        i = index.get(id(fut))
        if i is not None:
            rec.events.append(["wait", i, task()])

    stop = engine.observe(observe)
    engine.wait_observer = waited
    try:
        yield rec
    finally:
        engine.wait_observer = None
        stop()
        if path is not None:
            rec.save(path.replace("{rank}", str(rec.rank)))


def _decode(fut: Any, after: list[int]) -> Recorded:
    lane = fut.lane
    routed = fut.args[0] is None  # routed by its agreed size: its backend is decided later
    rec = Recorded(fut.kind, lane.comm.name, lane.size, "auto" if routed else lane.backend_name,
                   after=tuple(after))
    args = fut.args
    bufs = [a for a in args if isinstance(a, Buffer)]
    if bufs:
        b = bufs[0]
        rec.dtype = b.dtype.value
        rec.itemsize = b.obj.itemsize
        rec.buf = (b.addr, b.stop)
        rec.row = b.row_elems() if b.shape else 1
        if len(bufs) > 1:
            o = bufs[1]
            rec.out, rec.out_fresh = (o.addr, o.stop), o.fresh
    ints = [a for a in args[2:] if type(a) is int]
    if fut.stream is not None:  # a send or receive
        rec.peer, rec.tag = fut.stream[0], fut.stream[1]
    elif ints:
        rec.root = ints[0]
    ops = [a for a in args if type(a) is ReduceOp]
    if ops:
        rec.op = ops[0].value
    if fut.kind == "alltoallv":
        rec.counts = tuple(int(c) for c in args[2])
        if len(args) > 4 and args[4] is not None:
            rec.recv_counts = tuple(int(c) for c in args[4])
    rec.members = tuple(lane.comm.members)
    rec.name = fut.name
    return rec


def _out_bytes(op: Recorded, world: int) -> int | None:
    """Bytes of an operation's output buffer, the same on every rank (SPMD)."""
    if op.buf is None:
        return None
    nbytes = op.buf[1] - op.buf[0]
    n = world if op.comm == "world" else op.comm_size
    if op.kind in ("allgather", "gather"):
        return nbytes * n
    if op.kind in ("scatter", "reduce_scatter"):
        return nbytes // n
    if op.kind == "alltoall":
        return nbytes
    if op.kind == "alltoallv":
        return n * max(op.counts, default=0) * op.row * op.itemsize
    return None


def _to_program(rec: Recording, size: int, reassign: Mapping[int, str]) -> Program:
    # Slots: each dtype's recorded byte ranges, merged where they overlap (one allocation);
    # a fresh output (allocated by mcrdl) is a slot of its own.
    spans: list[list[Any]] = []  # [dtype, itemsize, lo, hi]

    def slot_of(dtype: str, itemsize: int, lo: int, hi: int) -> tuple[int, int]:
        for k, (d, size_, slo, shi) in enumerate(spans):
            if d == dtype and lo < shi and slo < hi:
                spans[k] = [d, size_, min(lo, slo), max(hi, shi)]
                return k, lo
        spans.append([dtype, itemsize, lo, hi])
        return len(spans) - 1, lo

    comms: dict[str, tuple[int, int]] = {"world": (0, 0)}
    splits: list[tuple[int | None, ...]] = []
    refs = []
    for i, op in enumerate(rec.ops):
        if op.kind in ("send", "recv"):
            raise ValueError(f"operation {i} is a {op.kind}: point-to-point operations cannot "
                             "be replayed from one rank's recording; record every rank and "
                             "use replay_ranks")
        if op.comm not in comms:
            k = op.comm_size
            if size % k:
                raise ValueError(f"communicator {op.comm} of size {k} does not divide a world "
                                 f"of {size} into blocks")
            splits.append(tuple(r // k for r in range(size)))
            comms[op.comm] = (len(splits), -1)  # color fixed per rank below
        n = size if op.comm == "world" else op.comm_size
        if op.kind == "alltoallv" and len(op.counts) != n:
            raise ValueError(f"operation {i} is an alltoallv recorded on a communicator of "
                             f"{len(op.counts)} ranks ({op.comm}): replay it where that "
                             f"communicator has that many, not {n}")
        buf = out = None
        if op.buf is not None and op.dtype is not None:
            buf = slot_of(op.dtype, op.itemsize, *op.buf), op.buf
        needed = _out_bytes(op, size)
        if needed is not None and op.dtype is not None:
            if op.out is not None and not op.out_fresh and op.out[1] - op.out[0] == needed:
                out = slot_of(op.dtype, op.itemsize, *op.out), op.out
            else:  # allocated by mcrdl, or absent on this rank (gather off the root)
                spans.append([op.dtype, op.itemsize, 0, needed])
                out = (len(spans) - 1, 0), (0, needed)
        refs.append((buf, out))
    # Byte ranges become element regions relative to their (final) slot's start.
    slots = tuple((d, max(1, (hi - lo) // size_)) for d, size_, lo, hi in spans)
    bases = [lo for _, _, lo, _ in spans]
    steps = []
    for i, (op, (buf, out)) in enumerate(zip(rec.ops, refs)):
        comm = comms[op.comm]
        n = size if op.comm == "world" else op.comm_size

        def region(ref: Any) -> Region | None:
            if ref is None:
                return None
            (slot, _), (lo, hi) = ref
            size_ = spans[slot][1]
            return Region(slot, (lo - bases[slot]) // size_, (hi - lo) // size_)

        counts: tuple[tuple[int, ...], ...] = ()
        if op.kind == "alltoallv":
            counts = tuple(tuple(c * op.row for c in op.counts) for _ in range(n))
        backend = reassign.get(i, None if op.backend == "auto" else op.backend)
        steps.append(Step(op.kind, comm if comm[0] == 0 else (comm[0], 0), backend,
                          region(buf), region(out), root=op.root,
                          op=ReduceOp(op.op) if op.op else None, counts=counts,
                          after=tuple(j for j in op.after if j < i)))
    # every rank joins its own block: rewrite the (split, color) of each step per rank
    program = Program(size, tuple(splits), slots, tuple(steps),
                      backends=tuple(sorted({s.backend for s in steps if s.backend})))
    return _spmd(program)


def _spmd(program: Program) -> Program:
    """One step per block for steps on a split communicator (each block runs it, SPMD).

    ``after`` indices are renumbered: an edge to a split step points at all of its copies,
    and each rank keeps the one it submits (run_program drops the others).
    """
    steps: list[Step] = []
    new_index: dict[int, list[int]] = {}
    for i, step in enumerate(program.steps):
        after = tuple(k for j in step.after for k in new_index.get(j, ()))
        split, _ = step.comm
        colors = [0] if split == 0 else sorted(
            {c for c in program.splits[split - 1] if c is not None})
        new_index[i] = []
        for c in colors:
            new_index[i].append(len(steps))
            steps.append(Step(step.kind, (split, c), step.backend, step.buf, step.out,
                              root=step.root, op=step.op, counts=step.counts, after=after))
    return Program(program.size, program.splits, program.slots, tuple(steps),
                   backends=program.backends)


def replay(recording: Recording, *, size: int | None = None, seeds: Iterable[int] = range(20),
           backends: Mapping[str, str] | None = None, reassign: bool = True) -> int:
    """Replay ``recording`` in the simulated world under many timings and backend choices.

    Each seed fixes an interleaving and, with ``reassign``, a backend per operation (the
    same on every rank) among ``backends`` (name -> semantics; default: the recorded
    backends, MPI-like). Returns how many runs passed.

    Raises:
        SimDeadlock, SimMismatch, AssertionError: a run hung, desynchronized or computed
            something else than the sequential reference.
    """
    from . import check_program

    names = sorted({op.backend for op in recording.ops} - {"auto"}) or ["mpi"]
    sems = dict(backends or {name: "mpi" for name in names})
    runs = 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        choice = {}
        if reassign:
            pool = sorted(sems)
            choice = {i: pool[int(rng.integers(len(pool)))] for i in range(len(recording.ops))}
        program = recording.to_program(size, choice)
        check_program(program, seed=seed, backends=sems)
        runs += 1
    return runs


def replay_ranks(recordings: Sequence[Recording], *, seeds: Iterable[int] = range(20),
                 semantics: Sequence[str] = ("mpi", "nccl"),
                 rename: Mapping[str, str] | None = None, **world_args: Any) -> None:
    """Replay every rank's recording on the rank it came from, in simulated worlds (one per
    seed and semantics, as `check_step` runs a step); raise on the first that fails.

    Args:
        recordings: one per rank of the recorded world, in any order.
        seeds: as for `check_step`.
        semantics: as for `check_step`.
        world_args: as for `check_step`.
        rename: backend names the simulated world lacks (it has ``"mpi"`` and ``"gloo"``), to
            the one to replay them on: ``{"nccl": "gloo"}``.

    Raises:
        StepFailed: a run deadlocked, mismatched or raised, named by its semantics and seed.
        ValueError: recordings that are not one per rank of one world, or a backend the
            simulated world lacks.
    """
    from ._check import check_step

    recs = sorted(recordings, key=lambda r: r.rank)
    size = len(recs)
    if [r.rank for r in recs] != list(range(size)) or any(r.size != size for r in recs):
        raise ValueError(f"replay_ranks needs one recording per rank of one world: got ranks "
                         f"{[r.rank for r in recs]} of worlds of {sorted({r.size for r in recs})}")
    rename = dict(rename or {})
    for rec in recs:
        for i, op in enumerate(rec.ops):
            backend = rename.get(op.backend, op.backend)
            if backend not in ("auto", "mpi", "gloo"):
                raise ValueError(f"operation {i} of rank {rec.rank} ran on {op.backend!r}, "
                                 f"which the simulated world lacks: pass rename="
                                 f"{{{op.backend!r}: 'mpi'}} (or 'gloo')")
    splits = _split_plan(recs)

    def step(comm: Any) -> Any:
        return _replay_rank(comm, recs[comm.rank], splits, rename)

    check_step(step, sizes=(size,), seeds=seeds, semantics=semantics, **world_args)


def _split_plan(recs: Sequence[Recording]) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """The sub-communicators to make before replaying, as (parent, [(child, members)]) per
    recorded split, parents first: every communicator a recording used, and the parents of
    each (``world.2c1`` was split, second, from ``world``, with color 1)."""
    members: dict[str, tuple[int, ...]] = {}
    for rec in recs:
        for op in rec.ops:
            members.setdefault(op.comm, op.members)
    for name in list(members):  # parents no operation ran on: their members are unknown,
        parent = name  # but every child's members are among them
        while "." in parent:
            parent = parent.rsplit(".", 1)[0]
            members[parent] = tuple(sorted({*members.get(parent, ()), *members[name]}))
    splits: dict[tuple[str, int], list[tuple[str, tuple[int, ...]]]] = {}
    for name in members:
        if name == "world":
            continue
        parent, last = name.rsplit(".", 1)
        number = int(last.split("c", 1)[0])
        splits.setdefault((parent, number), []).append((name, members[name]))
    order = sorted(splits, key=lambda key: (key[0].count("."), key[0], key[1]))
    return [(parent, splits[parent, number]) for parent, number in order]


def _replay_rank(comm: Any, rec: Recording, splits: list[tuple[str, list[Any]]],
                 rename: Mapping[str, str]) -> Any:
    """Rank ``comm.rank``'s part of a replay: make the communicators, then its events."""
    comms = {"world": comm}
    me = comm.rank
    for parent_name, children in splits:
        parent = comms.get(parent_name)
        if parent is None:  # not a member of the parent: not of its children either
            continue
        mine = next(((name, m) for name, m in children if me in m), None)
        color = None if mine is None else int(mine[0].rsplit("c", 1)[1])
        child = parent.split(color, key=0 if mine is None else mine[1].index(me))
        if mine is not None:
            comms[mine[0]] = child
    # Submissions in the recorded order; each after the waits its task made before it (one
    # outside any task: after every wait so far). Another task's wait holds nothing back,
    # as it did not in the program: an operation a task waited for is waited for here
    # only once that task submits again (or at the end). Only operations are waited on,
    # so the simulated world sees every wait (nothing waits on an asyncio event of its own).
    futs: dict[int, Any] = {}
    waited: dict[int, list[int]] = {}  # per task, operations it waited for, not yet here
    for what, i, task in rec.events:
        if what == "wait":
            if i in futs:
                waited.setdefault(task, []).append(i)
            continue
        for t in [task] if task else list(waited):
            for j in waited.pop(t, ()):
                futs[j].wait()
        if not rec.ops[i].exchange:  # (the front makes the exchange again)
            futs[i] = _submit(comms, rec, i, futs, rename)
    for ops in waited.values():
        for j in ops:
            futs[j].wait()
    return None


def _submit(comms: dict[str, Any], rec: Recording, i: int, futs: dict[int, Any],
            rename: Mapping[str, str]) -> Any:
    """Submit recorded operation ``i`` on its communicator, with buffers of its sizes."""
    op = rec.ops[i]
    comm = comms[op.comm]
    backend = rename.get(op.backend, op.backend)
    kw: dict[str, Any] = {"backend": None if backend == "auto" else backend,
                          "after": [futs[j] for j in op.after if j in futs]}
    buf = None
    if op.buf is not None and op.dtype is not None:
        items = (op.buf[1] - op.buf[0]) // max(op.itemsize, 1)
        shape = (items // op.row, op.row) if op.row > 1 else (items,)
        buf = np.zeros(shape, dtype=op.dtype)
    kind = op.kind
    if kind in ("send", "recv"):  # (a receive from any source was recorded with no peer)
        return getattr(comm, kind)(buf, None if op.peer == ANY_PEER else op.peer, op.tag, **kw)
    kw["name"] = op.name
    if kind == "barrier":
        return comm.barrier(**kw)
    if kind in ("allreduce", "reduce_scatter"):
        return getattr(comm, kind)(buf, ReduceOp(op.op), **kw)
    if kind == "reduce":
        return comm.reduce(buf, op.root, ReduceOp(op.op), **kw)
    if kind in ("broadcast", "gather", "scatter"):
        return getattr(comm, kind)(buf, op.root, **kw)
    if kind == "alltoallv":
        return comm.alltoallv(buf, list(op.counts), recv_counts=op.recv_counts, **kw)
    return getattr(comm, kind)(buf, **kw)  # allgather, alltoall
