"""Debug mode: every collective's fingerprint is checked across its group before it is issued.

With ``MCRDL_DEBUG=1`` (or ``init(debug=True)``) each collective first allgathers a fingerprint
(its sequence number on the communicator, operation, dtype, shape, root, ReduceOp, backend, and
the name of the asyncio task that submitted it, where the program gave it one) on a lane of its
own, and is issued only once every member's fingerprint matches. A mismatch fails it with
``DesyncError`` on every member, naming what each rank submitted; a member that submitted
nothing leaves the exchange unfinished, which the per-operation timeout reports. The exchange
costs one small allgather per collective (``benchmarks/debug_cost.py``).

Collectives submitted from concurrent tasks reach a lane in an order that timing decides,
which may differ between ranks (rule 8 of docs/design.md). A task the program named
(``asyncio.create_task(..., name="microbatch-3")``) is in the fingerprint, so that two named
tasks' collectives that swap are found even where their shapes are equal. A task asyncio named
itself ("Task-7") is not: that number counts the tasks a rank created before, which ranks of
a correct program need not share (a pipeline stage makes helpers of its own). Two unnamed
tasks' collectives that swap are then found only where they differ; the mismatch's message
then suggests ``name=``. Each row also says whether its collective came from a task: a hint
for that message, never compared.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core._buffers import Buffer
from ..core._errors import DesyncError
from ..core._types import DType, OpKind, ReduceOp

__all__ = ["FIELDS", "check", "describe", "fingerprint", "of_operation", "task_id"]

_KINDS = list(OpKind)
_DTYPES = list(DType)
_OPS = list(ReduceOp)
_MAX_DIMS = 4
#: int64 fields per fingerprint: seq, kind, dtype, root, op, backend, task, ndim, dims...,
#: and last the hint (1: submitted from an asyncio task), which `check` does not compare.
FIELDS = 9 + _MAX_DIMS
#: The name asyncio gives a task the program did not name.
_AUTO_NAME = re.compile(r"Task-\d+")
#: Task names this rank fingerprinted, by checksum (to name them in a mismatch's message;
#: another rank's task of the same name has the same checksum).
_NAMES: dict[int, str] = {}


def task_id() -> tuple[int, bool]:
    """The submitting asyncio task as fingerprint fields: a checksum of its name (0 for none,
    or a name asyncio gave it), and whether the submission came from a task at all."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return 0, False
    task = asyncio.current_task()
    if task is None:
        return 0, False
    name = task.get_name()
    if _AUTO_NAME.fullmatch(name):
        return 0, True
    # The other named tasks too: a mismatch's message names another rank's task by a
    # checksum, which this rank can then put a name to.
    for other in asyncio.all_tasks():
        other_name = other.get_name()
        if not _AUTO_NAME.fullmatch(other_name):
            _NAMES.setdefault(zlib.crc32(other_name.encode()) + 1, other_name)
    return zlib.crc32(name.encode()) + 1, True


def fingerprint(seq: int, kind: OpKind, dtype: DType | None, shape: Sequence[int],
                root: int, op: ReduceOp | None, backend: int,
                task: tuple[int, bool] = (0, False)) -> np.ndarray:
    """A collective's fingerprint as int64s (shapes beyond 4 dims fold into the last)."""
    dims = list(shape)
    if len(dims) > _MAX_DIMS:
        dims = [*dims[:_MAX_DIMS - 1], int(np.prod(dims[_MAX_DIMS - 1:]))]
    row = [seq, _KINDS.index(kind), -1 if dtype is None else _DTYPES.index(dtype), root,
           -1 if op is None else _OPS.index(op), backend, task[0], len(shape), *dims]
    row += [0] * (FIELDS - 1 - len(row))
    row.append(int(task[1]))
    return np.array(row, dtype=np.int64)


def of_operation(seq: int, kind: OpKind, backend: str | None, args: tuple[Any, ...],
                 backends: Sequence[str], task: tuple[int, bool] = (0, False)) -> np.ndarray:
    """The fingerprint of a collective started with ``args`` (its start's arguments, the
    group first) on ``backend`` (None: routed by its agreed size), of a communicator whose
    backends are ``backends`` (sorted: the same on every member)."""
    # Scatter's input exists on the root only, so its output describes it; alltoallv's
    # row counts differ per rank, so only its row shape.
    bufs = [a for a in args[1:] if isinstance(a, Buffer)]
    buf = bufs[-1] if kind is OpKind.SCATTER and bufs else (bufs[0] if bufs else None)
    dtype, shape = (buf.dtype, buf.shape) if buf is not None else (None, ())
    if kind is OpKind.ALLTOALLV:
        shape = shape[1:]
    root = next((a for a in args[2:] if type(a) is int), -1)
    op = next((a for a in args if type(a) is ReduceOp), None)
    return fingerprint(seq, kind, dtype, shape, root, op,
                       -1 if backend is None else list(backends).index(backend), task)


def describe(row: np.ndarray, backends: Sequence[str], seq: bool = True) -> str:
    """``allreduce#7 float32[4, 2] op=SUM on mpi`` for a fingerprint row (without ``#7``
    where not ``seq``), and the task it came from, if any."""
    number, kind, dtype, root, op, backend, task, ndim = (int(v) for v in row[:8])
    dims = [int(d) for d in row[8:8 + min(ndim, _MAX_DIMS)]]
    text = f"{_KINDS[kind].value}#{number}" if seq else _KINDS[kind].value
    if dtype >= 0:
        text += f" {_DTYPES[dtype].value}{dims}"
    if _KINDS[kind] in (OpKind.BROADCAST, OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER):
        text += f" root={root}"
    if op >= 0:
        text += f" op={_OPS[op].name}"
    name = backends[backend] if 0 <= backend < len(backends) else f"backend {backend}"
    text = f"{text} on {name}"
    if task:
        known = _NAMES.get(task)
        text += (f" from task {known!r}" if known is not None
                 else f" from a task named otherwise (checksum {task - 1:08x})")
    elif row[-1]:
        text += " from an unnamed task"
    return text


def check(table: np.ndarray, comm: str, backends: Sequence[str]) -> None:
    """Raise DesyncError unless every member's fingerprint (a row of ``table``) agrees on
    every field but the hint."""
    keys = table[:, :-1]
    if (keys == keys[0]).all():
        return
    lines = [f"rank {r}: {describe(row, backends)}" for r, row in enumerate(table)]
    text = (f"members of communicator {comm} submitted different collectives at the same "
            f"position: " + "; ".join(lines))
    if table[:, -1].any():
        text += (". Collectives from concurrent asyncio tasks reach a communicator in an "
                 "order that timing decides, which may differ between ranks (rule 8 of "
                 "docs/design.md): pass name= to each (matched by name across the ranks), or "
                 "submit them from one task")
    raise DesyncError(text)
