"""Record the collectives one rank submits in a real step; replay them in the simulated world.

::

    with mcrdl.testing.record(comm) as rec:
        train_step(comm)                 # real backends, real data
    rec.save("step.json")
    mcrdl.testing.replay(rec, seeds=range(50))   # simulated: many timings and backend choices

The recording keeps, per operation (read from its descriptor as it is submitted): the kind, the
communicator (name, size), the backend ("auto" where it is decided by the agreed size), the
dtype and byte ranges of its buffers (so buffer reuse, and with it the hazards across
backends, is reproduced), the root, the ReduceOp and the ``after=`` edges. A replay assumes
SPMD, as data- and expert-parallel training steps are: every rank submits the same sequence.
A sub-communicator of size k is replayed as blocks of k consecutive ranks. Point-to-point
operations cannot be replayed from one rank's view (the peers' halves are not in it) and are
refused with a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..core._buffers import Buffer
from ..core._types import ReduceOp
from ._programs import Program, Region, Step

__all__ = ["Recording", "record", "replay"]

_FORMAT = 1


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


@dataclass
class Recording:
    """The operations a rank submitted, in order (see the module docstring)."""

    size: int
    rank: int
    ops: list[Recorded] = field(default_factory=list)

    def save(self, path: str) -> None:
        """Write the recording as JSON."""
        data = {"format": _FORMAT, "size": self.size, "rank": self.rank,
                "ops": [asdict(op) for op in self.ops]}
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
        return cls(data["size"], data["rank"], ops)

    def to_program(self, size: int | None = None,
                   backends: Mapping[int, str] | None = None) -> Program:
        """The recording as a `Program` for ``size`` ranks (default: the recorded size).

        ``backends`` maps operation indices to another backend name (a replay's assignment).
        """
        return _to_program(self, size or self.size, backends or {})


@contextmanager
def record(comm: Any) -> Iterator[Recording]:
    """Record every operation submitted through ``comm``'s runtime inside the block.

    Each operation is read from its descriptor as it is submitted (``Engine.observe``): an
    alltoallv whose counts are exchanged appears as the exchange and the data exchange,
    with the edge between them.
    """
    engine = comm.runtime.engine
    rec = Recording(comm.runtime.world.size, comm.runtime.world.rank)
    index: dict[int, int] = {}  # id(future) -> op index
    kept: list[Any] = []  # the recorded futures, so that their ids stay theirs

    def observe(fut: Any, after: tuple[Any, ...]) -> None:
        if fut.kind == "fingerprint":
            return
        index[id(fut)] = len(rec.ops)
        kept.append(fut)
        rec.ops.append(_decode(fut, [index[id(f)] for f in after if id(f) in index]))

    stop = engine.observe(observe)
    try:
        yield rec
    finally:
        stop()


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
    if ints and fut.kind not in ("send", "recv"):
        rec.root = ints[0]
    ops = [a for a in args if type(a) is ReduceOp]
    if ops:
        rec.op = ops[0].value
    if fut.kind == "alltoallv":
        rec.counts = tuple(int(c) for c in args[2])
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
                             "be replayed from one rank's recording")
        if op.comm not in comms:
            k = op.comm_size
            if size % k:
                raise ValueError(f"communicator {op.comm} of size {k} does not divide a world "
                                 f"of {size} into blocks")
            splits.append(tuple(r // k for r in range(size)))
            comms[op.comm] = (len(splits), -1)  # color fixed per rank below
        if op.kind == "alltoallv" and len(op.counts) != size:
            raise ValueError(f"operation {i} is an alltoallv recorded on {len(op.counts)} "
                             f"ranks: replay it on that many, not {size}")
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
