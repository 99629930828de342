"""Well-formed multi-rank programs: their model, and a runner for one rank's communicator.

A `Program` is one global sequence of `Step`s (collectives on a communicator, or one
send/recv pair); each rank's own program is the subsequence of steps it takes part in, so
every communicator's members submit the same collectives in the same order and every send
has its receive: the programs are well formed by construction. On top of that a program
fixes per-rank delays, extra ``after=`` edges, the order in which each rank waits on its
futures (some right after submitting, the rest at the end, in a per-rank order), and
`Fault`s: one rank's operation cancelled, failing, or depending on one that fails, or the
rank's process dying before it submits a step (`DEATH`).

Some runs of consecutive collectives are *concurrent blocks*: named collectives (``name=``,
rule 8 of docs/design.md) that touch disjoint bytes and do not depend on one another, as several
asyncio tasks would submit them; each rank submits a block in an order of its own.

Buffers are 1-D numpy "slots" per rank; a step reads and writes *regions* of them, so steps
share bytes (and hazards across backends arise) whenever their regions overlap. In a *device*
program the slots live on each rank's simulated device (`mcrdl.testing._device`) and
``"kernel"`` steps are the rank's own compute on its current stream (``x = 2x - tag`` on a
region); a kernel first makes the stream wait (``wait_stream``) for the rank's earlier
operations on bytes it touches, as correct GPU code does, and operations submitted after it
must see its result without any host synchronization.

`run_program` runs a program on one rank's communicator (simulated or real); ``_reference``
computes every rank's final slots by executing the steps one after another with numpy (and,
under faults, which elements a correct runtime must have right); ``_generate`` draws them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core._errors import InvalidStateError
from ..core._types import ReduceOp

__all__ = ["DEATH", "FAULTS", "KINDS", "Fault", "Program", "Region", "Step", "initial_slots",
           "run_program"]

#: Step kinds: the communicator's operations, with send/recv as one "sendrecv" step (and, in
#: a device program, "kernel").
KINDS = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter",
         "reduce_scatter", "alltoall", "alltoallv", "sendrecv", "barrier")
#: Fault kinds (see `Fault`); the last two need a simulated world to inject them.
FAULTS = ("cancel", "dependency", "start", "error")
#: The fault of a rank whose process dies before it submits the step (a simulated world's
#: `SimWorld.kill`); its survivors go on (docs/design.md, rule 9).
DEATH = "death"


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
class Fault:
    """World rank ``rank`` cannot run step ``step`` as its peers will.

    ``kind``: ``"cancel"`` (the rank cancels the step's operation before it is issued),
    ``"dependency"`` (it depends on an operation of the rank's own that is cancelled),
    ``"start"`` (its start fails on that rank), ``"error"`` (its backend reports a failure on
    that rank once it has run), ``"death"`` (the rank's process dies before it submits the
    step). The last three are injected by a simulated world.
    """

    step: int
    rank: int
    kind: str


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
    faults: tuple[Fault, ...] = ()
    blocks: tuple[tuple[int, ...], ...] = ()
    orders: tuple[tuple[tuple[int, ...], ...], ...] = ()
    device: bool = False

    @property
    def named(self) -> dict[int, str]:
        """The name of each step in a concurrent block (``blocks``), by step index."""
        return {i: f"s{i}" for block in self.blocks for i in block}

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

#: What ``run_program`` records for a step whose operation succeeded.
DONE = "done"


def run_program(program: Program, comm: Any, *, pause: Callable[[int], None] | None = None,
                outcomes: dict[int, str] | None = None,
                inject: Callable[[str, list[Any]], None] | None = None,
                kill: Callable[[], None] | None = None) -> list[np.ndarray]:
    """Run ``program`` as rank ``comm.rank`` of ``comm`` (a world); return its final slots.

    ``pause(n)`` implements the per-rank delays (the simulated world's ``sleep``; a real run
    sleeps ``n`` x 100 µs). With ``outcomes``, a step's failure is recorded there (step
    index -> ``"done"`` or the exception's class name) instead of raised. ``inject(kind,
    objects)`` makes the operation on those buffers fail in its backend (``"start"`` or
    ``"error"`` faults), and ``kill()`` ends this rank's process (``"death"``: it does not
    return); without them such faults are skipped.
    """
    rank = comm.rank
    pause = pause or (lambda n: time.sleep(n * 1e-4))
    comms: dict[tuple[int, int], Any] = {(0, 0): comm}
    for i, colors in enumerate(program.splits):
        sub = comm.split(colors[rank])
        if sub is not None:
            comms[(i + 1, colors[rank])] = sub
    # A communicator of this rank alone: its own operations to cancel (no peers to break).
    solo = comm.split(rank) if program.faults else None
    faults = {f.step: f.kind for f in program.faults if f.rank == rank}
    names = program.named
    # A concurrent block is submitted, in this rank's order, where its first step is.
    later = {i: block for block in program.blocks for i in block[1:]}
    orders = {block[0]: program.orders[rank][b] if program.orders else block
              for b, block in enumerate(program.blocks)}
    slots = initial_slots(program, rank)
    device = None
    if program.device:  # (a simulated device: its kernels are Python functions)
        device = next(iter(comm.runtime.devices.values()))
        slots = [device.array(s) for s in slots]
    futs: dict[int, Any] = {}
    delays = program.delays[rank] if program.delays else ()
    mid = program.mid_waits[rank] if program.mid_waits else frozenset()
    doomed: list[Any] = []  # this rank's operations to cancel at its next wait
    mine = set(program.local_steps(rank))
    for i in [j for k in range(len(program.steps)) if k not in later
              for j in orders.get(k, (k,)) if j in mine]:
        step = program.steps[i]
        if faults.get(i) == DEATH and kill is not None:
            if outcomes is not None:  # (what finished before the death, as it ended)
                _record(futs, outcomes, finished_only=True)
            kill()
        if delays and delays[i]:
            pause(delays[i])
        if step.kind == "kernel":
            _kernel(program, step, device, slots, futs, outcomes is not None, doomed)
            continue
        after = [futs[j] for j in step.after if j in futs]
        futs[i] = _faulty(faults.get(i), program, step, comms[step.comm], slots, after, solo,
                          inject, doomed, names.get(i))
        if i in mid and i not in names:  # (a wait inside a concurrent block would block
            _wait(futs[i], outcomes, doomed)  # the other "tasks": never in asyncio)
    order = program.waits[rank] if program.waits else tuple(futs)
    for i in (*order, *futs):  # then anything the order left out
        if i in futs:  # (kernels have no future)
            _wait(futs[i], outcomes, doomed)
    if device is not None:
        device.synchronize()  # the kernels queued last
        slots = [np.array(s) for s in slots]
    if outcomes is not None:
        _record(futs, outcomes)
    for sub in comms.values():
        if sub is not comm:
            sub.close()
    if solo is not None:
        solo.close()
    return slots


def _record(futs: dict[int, Any], outcomes: dict[int, str], finished_only: bool = False) -> None:
    """How each of ``futs`` ended (``"done"`` or its error's class name), into ``outcomes``;
    ``finished_only``: those that have."""
    for i, fut in futs.items():
        if finished_only and not fut.done():
            continue
        error = fut.exception()
        outcomes[i] = DONE if error is None else type(error).__name__


def _kernel(program: Program, step: Step, device: Any, slots: list[np.ndarray],
            futs: dict[int, Any], faults: bool, doomed: list[Any]) -> None:
    """Queue the kernel ``step`` on the current stream, after making the stream wait for the
    operations submitted so far that touch its region (``wait_stream``: no host wait).
    ``faults``: an operation that failed is passed over (its step's outcome says so), and
    the operations the faults doomed are cancelled first, as at any wait (`_wait`)."""
    _cancel(doomed)
    region = step.buf
    if region is None or device is None:
        raise ValueError(f"a kernel step runs on a device program's region: {step}")
    for j, fut in futs.items():
        other = program.steps[j]
        if any(r is not None and r.slot == region.slot and r.start < region.start + region.length
               and region.start < r.start + r.length for r in (other.buf, other.out)):
            try:
                fut.wait_stream()
            except Exception:
                if not faults:
                    raise
    view = region.view(slots)
    tag = step.tag

    def kernel() -> None:
        view[:] = view * 2 - tag

    device.launch(kernel)


def _wait(fut: Any, outcomes: dict[int, str] | None, doomed: list[Any]) -> None:
    """Wait for ``fut``, first cancelling the operations the faults doomed (late, so that
    later operations are queued behind them by then)."""
    _cancel(doomed)
    try:
        fut.wait()
    except Exception:
        if outcomes is None:
            raise


def _cancel(doomed: list[Any]) -> None:
    for victim in doomed:
        try:
            victim.cancel()
        except InvalidStateError:
            pass  # issued already (a background poll finished its gate first): no fault
    doomed.clear()


def _faulty(kind: str | None, program: Program, step: Step, comm: Any,
            slots: list[np.ndarray], after: list[Any], solo: Any,
            inject: Callable[[str, list[Any]], None] | None, doomed: list[Any],
            name: str | None = None) -> Any:
    """Submit ``step`` (named ``name``, if given), making it fail on this rank as the fault
    ``kind`` says."""
    if kind is None or kind == DEATH:  # (a death that was not injected: the step runs)
        return _submit(program, step, comm, slots, after, name=name)
    if kind in ("start", "error"):
        mark = (lambda objs: inject(kind, objs)) if inject is not None else None
        return _submit(program, step, comm, slots, after, mark, name)
    # Held back behind an operation of this rank's own that nothing polls until the rank
    # waits next: it is cancelled then (or, for "dependency", what it waits for is).
    gate = solo.barrier()
    if kind == "cancel":
        fut = _submit(program, step, comm, slots, [*after, gate], name=name)
        doomed.append(fut)
    else:  # "dependency"
        victim = solo.barrier(after=[gate])
        fut = _submit(program, step, comm, slots, [*after, victim], name=name)
        doomed.append(victim)
    return fut


def _submit(program: Program, step: Step, comm: Any, slots: list[np.ndarray],
            after: Sequence[Any], mark: Callable[[list[Any]], None] | None = None,
            name: str | None = None) -> Any:
    kw: dict[str, Any] = {"backend": step.backend, "after": after}
    if name is not None:
        kw["name"] = name
    me, n = comm.rank, comm.size
    kind = step.kind
    buf = step.buf.view(slots) if step.buf is not None else None
    out = step.out.view(slots) if step.out is not None else None
    if kind == "alltoallv":
        send = step.counts[me]
        recv = tuple(step.counts[i][me] for i in range(n))
        buf = step.buf.view(slots, sum(send))  # type: ignore[union-attr]
        out = step.out.view(slots, sum(recv))  # type: ignore[union-attr]
    if mark is not None:
        mark([a for a in (buf, out) if a is not None])
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
    if out is None:
        raise ValueError(f"{kind} step without an out region: {step}")
    if kind == "allgather":
        return comm.allgather(buf, out=out, **kw)
    if kind == "gather":
        return comm.gather(buf, step.root, out=out if me == step.root else None, **kw)
    if kind == "scatter":
        return comm.scatter(buf, step.root, out=out, **kw)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(buf, step.op, out=out, **kw)
    if kind == "alltoall":
        return comm.alltoall(buf, out=out, **kw)
    if kind == "alltoallv":
        return comm.alltoallv(buf, send, None if step.exchange else recv, out=out, **kw)
    raise AssertionError(f"unknown step kind {kind}")
