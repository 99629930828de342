"""Vocabulary shared by every layer: operation kinds, reductions and dtypes, as enums."""

from __future__ import annotations

import enum

__all__ = ["COLLECTIVES", "DType", "OpKind", "REDUCING", "ReduceOp"]


class ReduceOp(enum.Enum):
    """How a reducing operation combines the members' buffers, element by element.

    On ``bool`` buffers SUM and MAX are logical OR, PROD and MIN logical AND. AVG is the exact
    SUM divided by the group size; a backend without a native AVG gets SUM followed by the
    division, and AVG on integer dtypes is refused (it would truncate). BAND, BOR and BXOR
    are bitwise AND, OR and XOR, on integer and bool buffers only (on bool: logical).
    """

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @property
    def is_bitwise(self) -> bool:
        """True for BAND, BOR and BXOR (integer and bool buffers only)."""
        return self in _BITWISE

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's
    # own __hash__ is Python code, and these are dict keys on every operation's path).
    __hash__ = object.__hash__


_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


class OpKind(enum.Enum):
    """The operations a communicator offers; a backend starts each with ``start_<value>``."""

    SEND = "send"
    RECV = "recv"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALLREDUCE = "allreduce"
    GATHER = "gather"
    ALLGATHER = "allgather"
    SCATTER = "scatter"
    REDUCE_SCATTER = "reduce_scatter"
    ALLTOALL = "alltoall"
    ALLTOALLV = "alltoallv"
    BARRIER = "barrier"

    __hash__ = object.__hash__


#: Operations that every member of a communicator must submit in the same order.
COLLECTIVES = frozenset(OpKind) - {OpKind.SEND, OpKind.RECV}
#: Operations that take a ReduceOp.
REDUCING = frozenset({OpKind.REDUCE, OpKind.ALLREDUCE, OpKind.REDUCE_SCATTER})


class DType(enum.Enum):
    """Element types a buffer may hold, named as torch and numpy name them."""

    BOOL = "bool"
    UINT8 = "uint8"
    INT8 = "int8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    UINT16 = "uint16"
    UINT32 = "uint32"
    UINT64 = "uint64"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    COMPLEX64 = "complex64"
    COMPLEX128 = "complex128"

    __hash__ = object.__hash__

    @property
    def is_floating(self) -> bool:
        """True for real and complex floating-point types (the ones AVG can divide exactly)."""
        return self in _FLOATING

    @property
    def is_complex(self) -> bool:
        """True for complex64 and complex128 (no ordering: MIN and MAX are undefined)."""
        return self in (DType.COMPLEX64, DType.COMPLEX128)


_FLOATING = frozenset(
    {DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64, DType.COMPLEX64, DType.COMPLEX128}
)
