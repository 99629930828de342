"""Well-formed multi-rank programs: their model, a runner, a sequential reference, a generator.

A `Program` is one global sequence of `Step`s (collectives on a communicator, or one
send/recv pair); each rank's own program is the subsequence of steps it takes part in, so
every communicator's members submit the same collectives in the same order and every send
has its receive: the programs are well formed by construction. On top of that a program
fixes per-rank delays, extra ``after=`` edges, and the order in which each rank waits on its
futures (some right after submitting, the rest at the end, in a per-rank order).

Buffers are 1-D numpy "slots" per rank; a step reads and writes *regions* of them, so steps
share bytes (and hazards across backends arise) whenever their regions overlap.

`run_program` runs a program on one rank's communicator (simulated or real); `reference`
computes every rank's final slots by executing the steps one after another with numpy; a
correct runtime makes the two equal, whatever the backends, timing and wait orders.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._types import ReduceOp
from ..backends.sim import reduce_stack

__all__ = ["KINDS", "Program", "Region", "Step", "initial_slots", "programs", "reference",
           "run_program"]

#: Step kinds: the communicator's operations, with send/recv as one "sendrecv" step.
KINDS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter",
         "reduce_scatter", "alltoall", "alltoallv", "sendrecv", "barrier")
_IN_PLACE = ("allreduce", "broadcast", "reduce", "sendrecv")


@dataclass(frozen=True)
class Region:
    """Elements [start, start + length) of slot ``slot``."""

    slot: int
    start: int
    length: int

    def view(self, slots: list[np.ndarray], length: int | None = None) -> np.ndarray:
        n = self.length if length is None else length
        return slots[self.slot][self.start:self.start + n]


@dataclass(frozen=True)
class Step:
    """One global step. ``comm`` is (split index, color); (0, 0) is the world.

    Lengths: ``buf.length`` is the per-member input (for scatter, reduce_scatter, alltoall:
    size x chunk); for alltoallv the regions are capacities and ``counts[i][j]`` is what group
    rank i sends to group rank j. For sendrecv, ``root`` sends to ``peer`` with ``tag``.
    """

    kind: str
    comm: tuple[int, int]
    backend: str | None
    buf: Region | None = None
    out: Region | None = None
    root: int = 0
    peer: int = 0
    tag: int = 0
    op: ReduceOp | None = None
    counts: tuple[tuple[int, ...], ...] = ()
    exchange: bool = False
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class Program:
    """A well-formed program for ``size`` ranks (see the module docstring)."""

    size: int
    splits: tuple[tuple[int | None, ...], ...]
    slots: tuple[tuple[str, int], ...]
    steps: tuple[Step, ...]
    delays: tuple[tuple[int, ...], ...] = ()
    mid_waits: tuple[frozenset[int], ...] = ()
    waits: tuple[tuple[int, ...], ...] = ()
    backends: tuple[str, ...] = field(default=("mpi", "gloo"))

    def members(self, comm: tuple[int, int]) -> tuple[int, ...]:
        """World ranks of a communicator, in its rank order."""
        split, color = comm
        if split == 0:
            return tuple(range(self.size))
        colors = self.splits[split - 1]
        return tuple(r for r in range(self.size) if colors[r] == color)

    def takes_part(self, step: Step, rank: int) -> bool:
        """Whether ``rank`` submits anything for ``step``."""
        members = self.members(step.comm)
        if step.kind == "sendrecv":
            return rank in (members[step.root], members[step.peer])
        return rank in members

    def local_steps(self, rank: int) -> list[int]:
        """The indices of the steps ``rank`` submits, in order."""
        return [i for i, s in enumerate(self.steps) if self.takes_part(s, rank)]


def initial_slots(program: Program, rank: int) -> list[np.ndarray]:
    """Every rank starts from small, rank-dependent integer values."""
    out = []
    for k, (dtype, length) in enumerate(program.slots):
        values = (np.arange(length) * (k + 3) + 7 * rank) % 11 - 3
        out.append(values.astype(dtype))
    return out


# -- running on a communicator ------------------------------------------------------------


def run_program(program: Program, comm: Any, *, pause: Callable[[int], None] | None = None
                ) -> list[np.ndarray]:
    """Run ``program`` as rank ``comm.rank`` of ``comm`` (a world); return its final slots.

    ``pause(n)`` implements the per-rank delays (the simulated world's ``sleep``; a real run
    sleeps ``n`` x 100 µs).
    """
    rank = comm.rank
    pause = pause or (lambda n: time.sleep(n * 1e-4))
    comms: dict[tuple[int, int], Any] = {(0, 0): comm}
    for i, colors in enumerate(program.splits):
        sub = comm.split(colors[rank])
        if sub is not None:
            comms[(i + 1, colors[rank])] = sub
    slots = initial_slots(program, rank)
    futs: dict[int, Any] = {}
    delays = program.delays[rank] if program.delays else ()
    mid = program.mid_waits[rank] if program.mid_waits else frozenset()
    for i in program.local_steps(rank):
        step = program.steps[i]
        if delays and delays[i]:
            pause(delays[i])
        after = [futs[j] for j in step.after if j in futs]
        futs[i] = _submit(program, step, comms[step.comm], slots, after)
        if i in mid:
            futs[i].wait()
    order = program.waits[rank] if program.waits else tuple(futs)
    for i in order:
        futs[i].wait()
    for i in futs:  # anything the order left out
        futs[i].wait()
    for sub in comms.values():
        if sub is not comm:
            sub.close()
    return slots


def _submit(program: Program, step: Step, comm: Any, slots: list[np.ndarray],
            after: Sequence[Any]) -> Any:
    kw = {"backend": step.backend, "after": after}
    me, n = comm.rank, comm.size
    kind = step.kind
    buf = step.buf.view(slots) if step.buf is not None else None
    if kind == "allreduce":
        return comm.allreduce(buf, step.op, **kw)
    if kind == "broadcast":
        return comm.broadcast(buf, step.root, **kw)
    if kind == "reduce":
        return comm.reduce(buf, step.root, step.op, **kw)
    if kind == "barrier":
        return comm.barrier(**kw)
    if kind == "sendrecv":
        if me == step.root:
            return comm.send(buf, step.peer, step.tag, **kw)
        return comm.recv(buf, step.root, step.tag, **kw)
    out_region = step.out
    if out_region is None:
        raise ValueError(f"{kind} step without an out region: {step}")
    if kind == "allgather":
        return comm.allgather(buf, out=out_region.view(slots), **kw)
    if kind == "gather":
        out = out_region.view(slots) if me == step.root else None
        return comm.gather(buf, step.root, out=out, **kw)
    if kind == "scatter":
        return comm.scatter(buf, step.root, out=out_region.view(slots), **kw)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(buf, step.op, out=out_region.view(slots), **kw)
    if kind == "alltoall":
        return comm.alltoall(buf, out=out_region.view(slots), **kw)
    if kind == "alltoallv":
        send = step.counts[me]
        recv = tuple(step.counts[i][me] for i in range(n))
        src = step.buf.view(slots, sum(send))  # type: ignore[union-attr]
        out = out_region.view(slots, sum(recv))
        return comm.alltoallv(src, send, None if step.exchange else recv, out=out, **kw)
    raise AssertionError(f"unknown step kind {kind}")


# -- the sequential reference ------------------------------------------------------------


def reference(program: Program) -> list[list[np.ndarray]]:
    """Every rank's final slots when the steps run one after another (numpy)."""
    state = [initial_slots(program, r) for r in range(program.size)]
    for step in program.steps:
        members = program.members(step.comm)
        n = len(members)
        kind = step.kind

        def buf(r: int, length: int | None = None) -> np.ndarray:
            return step.buf.view(state[r], length)  # type: ignore[union-attr]

        def out(r: int, length: int | None = None) -> np.ndarray:
            return step.out.view(state[r], length)  # type: ignore[union-attr]

        if kind == "barrier":
            continue
        if kind == "sendrecv":
            buf(members[step.peer])[:] = buf(members[step.root])
        elif kind in ("allreduce", "reduce"):
            red = _native(step.op)
            value = reduce_stack(np.stack([buf(m) for m in members]), red)
            if step.op is ReduceOp.AVG:
                value = value / n
            targets = members if kind == "allreduce" else (members[step.root],)
            for m in targets:
                buf(m)[:] = value
        elif kind == "broadcast":
            value = buf(members[step.root]).copy()
            for m in members:
                buf(m)[:] = value
        elif kind in ("allgather", "gather"):
            whole = np.concatenate([buf(m) for m in members])
            for m in members if kind == "allgather" else (members[step.root],):
                out(m)[:] = whole
        elif kind == "scatter":
            chunks = np.split(buf(members[step.root]), n)
            for i, m in enumerate(members):
                out(m)[:] = chunks[i]
        elif kind == "reduce_scatter":
            value = reduce_stack(np.stack([buf(m) for m in members]), _native(step.op))
            if step.op is ReduceOp.AVG:
                value = value / n
            for i, chunk in enumerate(np.split(value, n)):
                out(members[i])[:] = chunk
        elif kind == "alltoall":
            parts = [np.split(buf(m), n) for m in members]
            for j, m in enumerate(members):
                out(m)[:] = np.concatenate([parts[i][j] for i in range(n)])
        elif kind == "alltoallv":
            pieces = {}
            for i, m in enumerate(members):
                flat = buf(m, sum(step.counts[i]))
                offs = np.cumsum([0, *step.counts[i]])
                pieces[i] = [flat[offs[j]:offs[j + 1]].copy() for j in range(n)]
            for j, m in enumerate(members):
                recv = [pieces[i][j] for i in range(n)]
                total = sum(len(p) for p in recv)
                if total:
                    out(m, total)[:] = np.concatenate(recv)
        else:  # pragma: no cover
            raise AssertionError(kind)
    return state


def _native(op: ReduceOp | None) -> ReduceOp:
    if op is None:
        raise ValueError("a reducing step needs a ReduceOp")
    return ReduceOp.SUM if op is ReduceOp.AVG else op


# -- the generator (hypothesis) ------------------------------------------------------------


def programs(
    *,
    min_size: int = 2,
    max_size: int = 8,
    backends: Sequence[str] = ("mpi", "gloo"),
    auto: bool = True,
    kinds: Sequence[str] = KINDS,
    dtypes: Sequence[str] = ("float64", "int32"),
    ops: Sequence[ReduceOp] = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG),
    max_steps: int = 12,
    max_splits: int = 2,
    slot_length: int = 48,
) -> Any:
    """A hypothesis strategy of well-formed `Program`s (see the module docstring).

    Args:
        backends: names to pick from for each step (each step's choice is the same on every
            rank, as rule 4 of DESIGN.md requires); ``auto`` adds None (backend="auto").
        kinds, dtypes, ops: what steps may use (AVG only on floating dtypes).
    """
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> Program:
        size = draw(st.integers(min_size, max_size))
        splits = []
        for _ in range(draw(st.integers(0, max_splits))):
            style = draw(st.sampled_from(["strided", "blocks", "random"]))
            if style == "strided":
                k = draw(st.integers(1, size))
                colors: tuple[int | None, ...] = tuple(r % k for r in range(size))
            elif style == "blocks":
                k = draw(st.integers(1, size))
                colors = tuple(r // k for r in range(size))
            else:
                colors = tuple(draw(st.lists(st.one_of(st.none(), st.integers(0, 2)),
                                             min_size=size, max_size=size)))
            splits.append(colors)
        groups = [(0, 0)] + sorted({(i + 1, c) for i, cs in enumerate(splits)
                                    for c in cs if c is not None})
        nslots = draw(st.integers(2, 4))
        slots = tuple((draw(st.sampled_from(list(dtypes))), slot_length) for _ in range(nslots))
        prog = Program(size, tuple(splits), slots, (), backends=tuple(backends))
        choices: list[str | None] = [*backends, *([None] if auto else [])]
        steps: list[Step] = []
        for i in range(draw(st.integers(1, max_steps))):
            comm = draw(st.sampled_from(groups))
            n = len(prog.members(comm))
            kind = draw(st.sampled_from([k for k in kinds if k != "sendrecv" or n >= 2]))
            backend = draw(st.sampled_from(choices))
            slot = draw(st.integers(0, nslots - 1))
            dtype = slots[slot][0]
            floating = dtype.startswith("float")
            op = draw(st.sampled_from([o for o in ops if floating or o is not ReduceOp.AVG]))
            others = [s for s in range(nslots) if s != slot and slots[s][0] == dtype]
            after = tuple(sorted(set(draw(st.lists(st.integers(0, max(0, i - 1)), max_size=2)))
                                 )) if i else ()
            root = draw(st.integers(0, n - 1))
            cap = slot_length
            if kind in _IN_PLACE or kind == "barrier":
                length = draw(st.integers(0, cap // 2))
                start = draw(st.integers(0, cap - length))
                peer = (root + draw(st.integers(1, max(1, n - 1)))) % n
                steps.append(Step(kind, comm, backend, Region(slot, start, length), root=root,
                                  peer=peer, tag=draw(st.integers(0, 3)), op=op, after=after))
                continue
            if not others:
                continue  # out-of-place steps need a second slot of the same dtype
            out_slot = draw(st.sampled_from(others))
            chunk = draw(st.integers(0, max(0, cap // n // 2)))
            if kind in ("allgather", "gather"):
                src_len, out_len = chunk, n * chunk
            elif kind in ("scatter", "reduce_scatter"):
                src_len, out_len = n * chunk, chunk
            elif kind == "alltoall":
                src_len = out_len = n * chunk
            else:  # alltoallv: counts so that no rank sends or receives more than cap // 2
                limit = max(0, cap // 2 // n)
                counts = tuple(tuple(draw(st.integers(0, limit)) for _ in range(n))
                               for _ in range(n))
                steps.append(Step(kind, comm, backend, Region(slot, 0, cap // 2),
                                  Region(out_slot, 0, cap // 2), counts=counts,
                                  exchange=draw(st.booleans()), after=after))
                continue
            s0 = draw(st.integers(0, cap - src_len))
            o0 = draw(st.integers(0, cap - out_len))
            steps.append(Step(kind, comm, backend, Region(slot, s0, src_len),
                              Region(out_slot, o0, out_len), root=root, op=op, after=after))
        prog = Program(size, tuple(splits), slots, tuple(steps), backends=tuple(backends))
        delays, mids, waits = [], [], []
        for r in range(size):
            mine = prog.local_steps(r)
            delays.append(tuple(draw(st.sampled_from([0, 0, 0, 1, 3])) for _ in steps))
            mids.append(frozenset(draw(st.lists(st.sampled_from(mine), max_size=2)))
                        if mine else frozenset())
            waits.append(tuple(draw(st.permutations(mine))))
        return Program(size, tuple(splits), slots, tuple(steps), tuple(delays), tuple(mids),
                       tuple(waits), tuple(backends))

    return build()
