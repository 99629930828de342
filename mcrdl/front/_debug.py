"""Debug mode: every collective's fingerprint is checked across its group before it is issued.

With ``MCRDL_DEBUG=1`` (or ``init(debug=True)``) each collective first allgathers a fingerprint
(its sequence number on the communicator, operation, dtype, shape, root, ReduceOp, backend, and
the asyncio task that submitted it) on a lane of its own, and is issued only once every member's fingerprint matches. A mismatch fails
it with ``DesyncError`` on every member, naming what each rank submitted; a member that
submitted nothing leaves the exchange unfinished, which the per-operation timeout reports.
The exchange costs one small allgather per collective (``benchmarks/debug_cost.py``).

The task is in the fingerprint because collectives submitted from concurrent tasks reach a
lane in an order that timing decides, which differs between ranks (rule 8 of docs/design.md): two
tasks' allreduces of equal shape would otherwise be paired across tasks, silently. A task is
known by its name: asyncio numbers unnamed tasks in creation order ("Task-7"), which a
well-formed program shares across ranks; a named task by a checksum of its name.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence

import numpy as np

from ..core._errors import DesyncError
from ..core._types import DType, OpKind, ReduceOp

__all__ = ["FIELDS", "check", "describe", "fingerprint", "task_id"]

_KINDS = list(OpKind)
_DTYPES = list(DType)
_OPS = list(ReduceOp)
_MAX_DIMS = 4
#: int64 fields per fingerprint: seq, kind, dtype, root, op, backend, task, ndim, dims...
FIELDS = 8 + _MAX_DIMS
#: Task ids of named tasks (a checksum of the name) start here; below are "Task-N" numbers.
_NAMED = 1 << 40


def task_id() -> int:
    """The submitting asyncio task, as a fingerprint field: -1 outside any task, N for an
    unnamed task ("Task-N"), ``_NAMED`` plus a checksum of the name for a named one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return -1
    task = asyncio.current_task()
    if task is None:
        return -1
    name = task.get_name()
    number = name[5:] if name.startswith("Task-") else ""
    if number.isdigit():
        return int(number)
    return _NAMED + zlib.crc32(name.encode())


def fingerprint(seq: int, kind: OpKind, dtype: DType | None, shape: Sequence[int],
                root: int, op: ReduceOp | None, backend: int, task: int = -1) -> np.ndarray:
    """A collective's fingerprint as int64s (shapes beyond 4 dims fold into the last)."""
    dims = list(shape)
    if len(dims) > _MAX_DIMS:
        dims = [*dims[:_MAX_DIMS - 1], int(np.prod(dims[_MAX_DIMS - 1:]))]
    row = [seq, _KINDS.index(kind), -1 if dtype is None else _DTYPES.index(dtype), root,
           -1 if op is None else _OPS.index(op), backend, task, len(shape), *dims]
    row += [0] * (FIELDS - len(row))
    return np.array(row, dtype=np.int64)


def describe(row: np.ndarray, backends: Sequence[str], seq: bool = True) -> str:
    """``allreduce#7 float32[4, 2] op=SUM on mpi`` for a fingerprint row (without ``#7``
    where not ``seq``)."""
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
    if task >= _NAMED:
        text += f" from a task named (checksum {task - _NAMED:08x})"
    elif task >= 0:
        text += f" from Task-{task}"
    return text


def check(table: np.ndarray, comm: str, backends: Sequence[str]) -> None:
    """Raise DesyncError unless every member's fingerprint (a row of ``table``) agrees."""
    if (table == table[0]).all():
        return
    lines = [f"rank {r}: {describe(row, backends)}" for r, row in enumerate(table)]
    raise DesyncError(
        f"members of communicator {comm} submitted different collectives at the same "
        f"position: " + "; ".join(lines)
    )
