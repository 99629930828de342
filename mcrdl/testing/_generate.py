"""The generator of well-formed programs (hypothesis): communicators, steps, timing, faults.

Every drawn `Program` is well formed by construction (see ``_programs``): what varies is the
world's size and splits, the steps (every operation, buffer reuse across backends, ``after=``
edges), each rank's delays and wait order, and, where asked for, the faults injected on one
rank at one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core._types import ReduceOp
from ._programs import DEATH, FAULTS, KINDS, Fault, Program, Region, Step

__all__ = ["programs"]

_IN_PLACE = ("allreduce", "broadcast", "reduce", "sendrecv")


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
    max_faults: int = 0,
    min_faults: int = 0,
    faults: Sequence[str] = FAULTS,
    named: bool = False,
    device: bool = False,
) -> Any:
    """A hypothesis strategy of well-formed `Program`s (see ``_programs``).

    Args:
        backends: names to pick from for each step (each step's choice is the same on every
            rank, as rule 4 of docs/design.md requires); ``auto`` adds None (backend="auto").
        kinds: the operations steps may be.
        dtypes: the dtypes steps may use.
        ops: the reductions steps may use (AVG only on floating dtypes).
        min_faults: the fewest `Fault`s, each of a kind in ``faults``, at any step, on any
            rank that takes part in it.
        max_faults: the most of them.
        named: group runs of independent collectives into concurrent blocks of named
            operations, each rank submitting each block in an order of its own.
        device: slots on each rank's simulated device, and ``"kernel"`` steps among the
            others (a simulated world with ``device=True`` runs them).
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
            if device and draw(st.integers(0, 3)) == 0:
                slot = draw(st.integers(0, nslots - 1))
                length = draw(st.integers(1, slot_length // 2))
                start = draw(st.integers(0, slot_length - length))
                steps.append(Step("kernel", (0, 0), None, Region(slot, start, length),
                                  tag=draw(st.integers(0, 3))))
                continue
            comm = draw(st.sampled_from(groups))
            n = len(prog.members(comm))
            kind = draw(st.sampled_from([k for k in kinds if k != "sendrecv" or n >= 2]))
            backend = draw(st.sampled_from(choices))
            slot = draw(st.integers(0, nslots - 1))
            dtype = slots[slot][0]
            floating = dtype.startswith("float")
            op = draw(st.sampled_from([o for o in ops if floating or o is not ReduceOp.AVG]))
            others = [s for s in range(nslots) if s != slot and slots[s][0] == dtype]
            # (drawn over attempts, so that the search stays where it was; only edges to
            # steps made already are kept)
            drawn = draw(st.lists(st.integers(0, max(0, i - 1)), max_size=2)) if i else []
            after = tuple(sorted({j for j in drawn if j < len(steps)}))
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
        blocks = _blocks(draw, steps) if named else []
        orders = [tuple(tuple(draw(st.permutations(block))) for block in blocks)
                  for _ in range(size)] if blocks else []
        delays, mids, waits = [], [], []
        for r in range(size):
            mine = prog.local_steps(r)
            delays.append(tuple(draw(st.sampled_from([0, 0, 0, 1, 3])) for _ in steps))
            mids.append(frozenset(draw(st.lists(st.sampled_from(mine), max_size=2)))
                        if mine else frozenset())
            waits.append(tuple(draw(st.permutations(mine))))
        drawn = []
        count = 0
        if steps and max_faults:  # (no draw otherwise: programs without faults stay as they were)
            count = draw(st.integers(min_faults, max(min_faults, max_faults)))
        for _ in range(count):
            at = draw(st.integers(0, len(steps) - 1))
            who = [r for r in range(size) if prog.takes_part(steps[at], r)]
            fault = Fault(at, draw(st.sampled_from(who)), draw(st.sampled_from(faults)))
            if fault.kind != DEATH or all(f.kind != DEATH for f in drawn):  # (one death)
                drawn.append(fault)
        return Program(size, tuple(splits), slots, tuple(steps), tuple(delays), tuple(mids),
                       tuple(waits), tuple(backends), tuple(drawn), tuple(blocks),
                       tuple(orders), device)

    return build()


def _blocks(draw: Any, steps: list[Step]) -> list[tuple[int, ...]]:
    """Runs of consecutive steps that may be concurrent: collectives that touch disjoint
    regions (any overlap counts, whatever reads or writes it) and do not depend on one
    another; each step joins the run before it, starts a new one, or stays out."""
    from hypothesis import strategies as st

    blocks: list[list[int]] = []
    current: list[int] = []
    for i, step in enumerate(steps):
        how = draw(st.sampled_from(["join", "join", "new", "out"]))
        eligible = step.kind not in ("sendrecv", "kernel") and not (
            step.kind == "alltoallv" and step.exchange and step.backend is None)
        fits = (how == "join" and eligible and not set(step.after) & set(current)
                and not any(_overlap(step, steps[j]) for j in current))
        if fits:
            current.append(i)
            continue
        if current:
            blocks.append(current)
        current = [i] if eligible and how != "out" else []
    if current:
        blocks.append(current)
    return [tuple(b) for b in blocks]


def _overlap(a: Step, b: Step) -> bool:
    regions = [r for r in (a.buf, a.out) if r is not None]
    return any(r.slot == q.slot and r.start < q.start + q.length and q.start < r.start + r.length
               for r in regions for q in (b.buf, b.out) if q is not None)
