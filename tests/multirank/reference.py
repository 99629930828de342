"""Deterministic inputs per (case, rank) and numpy references for every operation."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from mcrdl import ReduceOp

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def np_dtype(name: str) -> np.dtype:
    # bfloat16 has no numpy dtype: its reference is computed in float32 (values are exact).
    return np.dtype("float32" if name == "bfloat16" else name)


def make(case: str, rank: int, dtype: str, shape: tuple[int, ...], op: ReduceOp | None = None
         ) -> np.ndarray:
    """Small integer values: every sum, product and average of them is exact in every dtype."""
    rng = np.random.default_rng(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    lo = 0 if dtype.startswith("uint") else -3
    hi = 3 if op is not ReduceOp.PROD else 2
    if op is ReduceOp.PROD and lo < 0:
        lo = -2
    values = rng.integers(lo, hi + 1, size=shape)
    if dtype.startswith("complex"):
        values = values + 1j * rng.integers(lo, hi + 1, size=shape)
    return values.astype(np_dtype(dtype))


def as_buffer(a: np.ndarray, dtype: str, kind: str):
    if kind == "numpy":
        return a.copy()
    t = torch.from_numpy(a.copy())
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy()


def reduce(stack: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction of ``stack`` (ranks along axis 0) with mcrdl's semantics."""
    n = stack.shape[0]
    dt = stack.dtype
    bitwise = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
               ReduceOp.BXOR: np.bitwise_xor}.get(op)
    if bitwise is not None:
        return bitwise.reduce(stack, axis=0)
    if dtype == "bool":
        any_ = stack.any(axis=0)
        all_ = stack.all(axis=0)
        return {ReduceOp.SUM: any_, ReduceOp.MAX: any_, ReduceOp.PROD: all_,
                ReduceOp.MIN: all_}[op]
    if op is ReduceOp.SUM:
        return stack.sum(axis=0, dtype=dt)
    if op is ReduceOp.PROD:
        return stack.prod(axis=0, dtype=dt)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    return (stack.sum(axis=0, dtype=dt) / n).astype(dt)


def alltoallv_counts(size: int, rows: int) -> list[list[int]]:
    """send_counts[i][j]: rows rank i sends to rank j (zeros included); each row sums to rows.

    No two ranks send each other the same number of rows (where ``rows >= size``), at any
    size, 2 included: of each pair, one sends ``rows // size`` and the other nothing (a
    round-robin tournament: rank i wins against the ranks 1 to ``(size - 1) // 2`` after it,
    and at an even size the lower of two ranks ``size / 2`` apart wins); the rest stays with
    the sender. So no rank receives the counts it sends, and an alltoallv that took its send
    counts for its receive counts gets a wrong result.
    """
    share = rows // size
    table = []
    for i in range(size):
        counts = [0] * size
        for j in range(size):
            ahead = (j - i) % size
            if 0 < ahead <= (size - 1) // 2 or (2 * ahead == size and i < j):
                counts[j] = share
        counts[i] = rows - sum(counts)
        table.append(counts)
    return table
