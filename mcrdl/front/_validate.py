"""The checks a call makes before anything is sent: bad input raises here, on the calling rank,
naming the value and the fix; nothing is converted, truncated or dropped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core._buffers import Buffer, as_buffer, new_buffer
from ..core._types import OpKind, ReduceOp
from ..engine._names import MAX_NAME_BYTES

__all__ = ["check_counts", "check_name", "check_op", "check_peer", "check_rank", "check_tag",
           "out_buffer", "split_shape", "with_rows"]

#: The largest tag every MPI library must accept (MPI_TAG_UB >= 32767).
MAX_TAG = 32767


def check_name(name: Any) -> None:
    """A collective's ``name=``: a non-empty string that fits an agreement round."""
    if type(name) is not str:
        raise TypeError(f"name must be a str, got {name!r}")
    if not name or "\0" in name or len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(
            f"name={name[:60]!r}: a name must be a non-empty string of at most "
            f"{MAX_NAME_BYTES} UTF-8 bytes without NUL characters"
        )


def with_rows(shape: Any, rows: int) -> tuple[int, ...]:
    """``shape`` (a buffer's) with ``rows`` in place of its dim 0. A 1-d shape, the common
    case, is not sliced: slicing a torch.Size shows in a small operation's overhead
    (docs/performance-log.md, "Fast paths kept and dropped")."""
    return (rows,) if len(shape) == 1 else (rows, *shape[1:])


def check_op(op: Any) -> ReduceOp:
    """A reduction: a `ReduceOp`, never a string or torch's enum."""
    if type(op) is ReduceOp:
        return op
    raise TypeError(f"op must be a mcrdl.ReduceOp (e.g. ReduceOp.SUM), got {op!r}")


def check_rank(name: str, value: Any, size: int) -> int:
    """A rank of a communicator of ``size``."""
    if type(value) is not int and not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    rank = int(value)
    if not 0 <= rank < size:
        raise ValueError(f"{name}={rank} out of range for communicator of size {size}")
    return rank


def check_peer(name: str, value: Any, size: int, rank: int) -> int:
    """A rank of a communicator of ``size`` other than this one's (``rank``)."""
    peer = check_rank(name, value, size)
    if peer == rank:
        raise ValueError(
            f"{name}={peer} is this rank; a message to oneself is a local copy: "
            "use tensor.copy_() instead"
        )
    return peer


def check_tag(tag: Any) -> int:
    """A message tag every backend accepts."""
    if type(tag) is not int and not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be an int, got {tag!r}")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag={tag} out of range; tags are 0..{MAX_TAG} on every backend")
    return int(tag)


def split_shape(kind: OpKind, b: Buffer, size: int, name: str = "buf") -> Any:
    """The shape of ``b``, whose dim 0 must split into ``size`` equal chunks."""
    shape = b.obj.shape
    if not shape:
        raise ValueError(
            f"{kind.value} splits dim 0, but {name} is 0-dimensional; pass "
            f"{name}.reshape(1) or a buffer with a leading dimension"
        )
    if shape[0] % size:
        raise ValueError(
            f"{kind.value} needs dim 0 of {name} divisible by the communicator size "
            f"{size}; got shape {tuple(b.shape)}"
        )
    return shape


def out_buffer(kind: OpKind, out: Any, b: Buffer, shape: tuple[int, ...] | None,
               size: int) -> Buffer:
    """A caller's ``out`` checked for a result of ``shape`` (None: any shape) from ``b`` on
    ``size`` ranks, or one allocated like ``b`` where none was given."""
    if out is None and shape is not None:
        return new_buffer(b.empty(shape), b.is_torch, b.dtype, b.device)
    o = as_buffer(out, "out", True)
    if o.dtype is not b.dtype:
        raise TypeError(
            f"out has dtype {o.dtype.value} but buf has {b.dtype.value}; they must match"
        )
    if o.device != b.device:
        raise ValueError(
            f"out is on {o.device} but buf is on {b.device}; pass an out on {b.device}"
        )
    # (the ends written out: Buffer.stop, a property, costs a call each)
    if o.nbytes and b.nbytes and o.addr < b.addr + b.nbytes and b.addr < o.addr + o.nbytes:
        raise ValueError(
            f"out overlaps buf; {kind.value} cannot run in place: pass a separate out"
        )
    if shape is not None and o.obj.shape != shape:  # torch.Size, numpy shapes == tuples
        raise ValueError(
            f"out has shape {tuple(o.shape)}; {kind.value} of buf with shape "
            f"{tuple(b.shape)} on {size} ranks needs {tuple(shape)}"
        )
    return o


def check_counts(name: str, counts: Sequence[int], size: int) -> tuple[int, ...]:
    """alltoallv's counts: ``size`` non-negative ints."""
    try:
        values = tuple(int(c) for c in counts)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {size} ints, got {counts!r}") from None
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries; the communicator has {size} ranks")
    if any(c < 0 for c in values):
        raise ValueError(f"{name} has a negative count: {list(values)}")
    return values
