"""The sequential reference: what every rank's slots hold when the steps run one after another.

`reference` executes a `Program`'s steps in order with numpy. `reference_with_faults` does the
same given what happened to each step on each rank (``run_program``'s outcomes), and also
says which elements a correct runtime must have right: a step that failed on a rank leaves
its output there undefined (it may or may not have been written), and so does a step whose
inputs were undefined on any member. Every other element was written by operations that
succeeded on that rank from inputs that were right, so it must equal the reference: a rank
that matched a different operation than its peers (docs/design.md rule 7) gets it wrong.
"""

from __future__ import annotations

import numpy as np

from ..backends.sim import reduce_stack
from ..core._types import ReduceOp
from ._programs import DONE, Program, Region, Step, initial_slots

__all__ = ["reference", "reference_with_faults"]

Outcomes = list[dict[int, str]]
Place = tuple[int, Region, int]  # (world rank, region, length)


def reference(program: Program) -> list[list[np.ndarray]]:
    """Every rank's final slots when the steps run one after another (numpy)."""
    return _run(program, None)[0]


def reference_with_faults(program: Program, outcomes: Outcomes
                          ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Every rank's reference slots, and the boolean masks of the elements that must match.

    ``outcomes[rank]`` maps each step the rank took part in to ``"done"`` or the name of
    the exception that failed it (``run_program(..., outcomes=...)``).
    """
    state, defined = _run(program, outcomes)
    return state, defined  # type: ignore[return-value]


def _run(program: Program, outcomes: Outcomes | None
         ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]] | None]:
    state = [initial_slots(program, r) for r in range(program.size)]
    defined = None
    if outcomes is not None:
        defined = [[np.ones(len(s), dtype=bool) for s in slots] for slots in state]
    for i, step in enumerate(program.steps):
        members = program.members(step.comm)
        _execute(step, members, state)
        if defined is None or outcomes is None:
            continue
        reads, writes = _places(step, members)
        inputs_ok = all(region.view(defined[r], n).all() for r, region, n in reads)
        for r, region, n in writes:
            ok = inputs_ok and (step.kind == "kernel" or outcomes[r].get(i) == DONE)
            region.view(defined[r], n)[:] = ok
    return state, defined


def _places(step: Step, members: tuple[int, ...]) -> tuple[list[Place], list[Place]]:
    """Where ``step`` reads (every member's inputs that its result depends on) and writes."""
    kind = step.kind
    buf, out = step.buf, step.out
    if kind == "barrier" or buf is None:
        return [], []
    n = len(members)
    root = members[step.root]
    if kind == "sendrecv":
        return [(root, buf, buf.length)], [(members[step.peer], buf, buf.length)]
    if kind == "kernel":
        return [(m, buf, buf.length) for m in members], [(m, buf, buf.length) for m in members]
    if kind in ("allreduce", "reduce", "broadcast"):  # in place
        sources = [root] if kind == "broadcast" else list(members)
        targets = {"allreduce": list(members), "reduce": [root],
                   "broadcast": [m for m in members if m != root]}[kind]
        return ([(m, buf, buf.length) for m in sources],
                [(m, buf, buf.length) for m in targets])
    if out is None:
        raise ValueError(f"{kind} step without an out region: {step}")
    if kind == "alltoallv":
        sends = [sum(step.counts[i]) for i in range(n)]
        recvs = [sum(step.counts[i][j] for i in range(n)) for j in range(n)]
        return ([(m, buf, sends[i]) for i, m in enumerate(members)],
                [(m, out, recvs[j]) for j, m in enumerate(members)])
    sources = [root] if kind == "scatter" else list(members)
    targets = [root] if kind == "gather" else list(members)
    return ([(m, buf, buf.length) for m in sources], [(m, out, out.length) for m in targets])


def _execute(step: Step, members: tuple[int, ...], state: list[list[np.ndarray]]) -> None:
    """Apply ``step`` to ``state`` (every rank's slots), as a correct runtime would."""
    n = len(members)
    kind = step.kind

    def buf(r: int, length: int | None = None) -> np.ndarray:
        return step.buf.view(state[r], length)  # type: ignore[union-attr]

    def out(r: int, length: int | None = None) -> np.ndarray:
        return step.out.view(state[r], length)  # type: ignore[union-attr]

    if kind == "barrier":
        return
    if kind == "kernel":  # every rank's own compute on its region
        for m in members:
            buf(m)[:] = buf(m) * 2 - step.tag
    elif kind == "sendrecv":
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


def _native(op: ReduceOp | None) -> ReduceOp:
    if op is None:
        raise ValueError("a reducing step needs a ReduceOp")
    return ReduceOp.SUM if op is ReduceOp.AVG else op
