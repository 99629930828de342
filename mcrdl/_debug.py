"""Debug mode: every collective's fingerprint is checked across its group before it is issued.

With ``MCRDL_DEBUG=1`` (or ``init(debug=True)``) each collective first allgathers a fingerprint
(its sequence number on the communicator, operation, dtype, shape, root, ReduceOp, backend) on
a lane of its own, and is issued only once every member's fingerprint matches. A mismatch fails
it with ``DesyncError`` on every member, naming what each rank submitted; a member that
submitted nothing leaves the exchange unfinished, which the per-operation timeout reports.
The exchange costs one small allgather per collective (``benchmarks/debug_cost.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import DesyncError
from ._types import DType, OpKind, ReduceOp

__all__ = ["FIELDS", "check", "describe", "fingerprint"]

_KINDS = list(OpKind)
_DTYPES = list(DType)
_OPS = list(ReduceOp)
_MAX_DIMS = 4
#: int64 fields per fingerprint: seq, kind, dtype, root, op, backend, ndim, dims...
FIELDS = 7 + _MAX_DIMS


def fingerprint(seq: int, kind: OpKind, dtype: DType | None, shape: Sequence[int],
                root: int, op: ReduceOp | None, backend: int) -> np.ndarray:
    """A collective's fingerprint as int64s (shapes beyond 4 dims fold into the last)."""
    dims = list(shape)
    if len(dims) > _MAX_DIMS:
        dims = [*dims[:_MAX_DIMS - 1], int(np.prod(dims[_MAX_DIMS - 1:]))]
    row = [seq, _KINDS.index(kind), -1 if dtype is None else _DTYPES.index(dtype), root,
           -1 if op is None else _OPS.index(op), backend, len(shape), *dims]
    row += [0] * (FIELDS - len(row))
    return np.array(row, dtype=np.int64)


def describe(row: np.ndarray, backends: Sequence[str]) -> str:
    """``allreduce#7 float32[4, 2] op=SUM on mpi`` for a fingerprint row."""
    seq, kind, dtype, root, op, backend, ndim = (int(v) for v in row[:7])
    dims = [int(d) for d in row[7:7 + min(ndim, _MAX_DIMS)]]
    text = f"{_KINDS[kind].value}#{seq}"
    if dtype >= 0:
        text += f" {_DTYPES[dtype].value}{dims}"
    if _KINDS[kind] in (OpKind.BROADCAST, OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER):
        text += f" root={root}"
    if op >= 0:
        text += f" op={_OPS[op].name}"
    name = backends[backend] if 0 <= backend < len(backends) else f"backend {backend}"
    return f"{text} on {name}"


def check(table: np.ndarray, comm: str, backends: Sequence[str]) -> None:
    """Raise DesyncError unless every member's fingerprint (a row of ``table``) agrees."""
    if (table == table[0]).all():
        return
    lines = [f"rank {r}: {describe(row, backends)}" for r, row in enumerate(table)]
    raise DesyncError(
        f"members of communicator {comm} submitted different collectives at the same "
        f"position: " + "; ".join(lines)
    )
