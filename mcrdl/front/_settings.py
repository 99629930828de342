"""The settings every rank must share, checked at ``init()``: the tuning table and
``fusion_bytes`` (`agree_on_settings`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..core._errors import MCRDLError

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["agree_on_settings"]

#: What a rank's tuning check says it holds (the first byte of its digest).
_NONE, _TABLE, _UNREADABLE = 0, 1, 2


def agree_on_settings(runtime: Runtime) -> None:
    """Check that every rank holds the same tuning table (the hash of its entries), or
    that none holds one, and the same ``fusion_bytes`` (every member must fuse alike).
    Every rank runs it at ``init()``, with a table or without: a rank that skipped it
    would match its first collective against the others' check.

    Raises:
        MCRDLError: a rank could not read its table, or the ranks hold different tables
            (or some none), or different ``fusion_bytes``; on every rank, naming what
            each holds.
    """
    digest = np.zeros(41, dtype=np.uint8)
    if runtime.tuning is not None:
        digest[0] = _TABLE
        digest[1:33] = np.frombuffer(bytes.fromhex(runtime.tuning.hash), dtype=np.uint8)
    elif runtime._tuning_error is not None:
        digest[0] = _UNREADABLE
    digest[33:] = np.frombuffer(runtime.config.fusion_bytes.to_bytes(8, "little"),
                                dtype=np.uint8)
    world = runtime.world
    table = world.allgather(digest, backend=runtime.control_of(world.backends)).wait().reshape(
        world.size, 41)
    fusion = [int.from_bytes(bytes(row[33:]), "little") for row in table]
    if len(set(fusion)) > 1:
        raise MCRDLError(
            "ranks do not have the same fusion_bytes: "
            + "; ".join(f"rank {rank}: {value}" for rank, value in enumerate(fusion))
            + "; give every rank the same (init(fusion_bytes=...) or MCRDL_FUSION_BYTES)")
    table = table[:, :33]
    if (table == table[0]).all() and table[0, 0] != _UNREADABLE:
        return
    names = {_NONE: "none", _UNREADABLE: "unreadable"}
    rows = [f"rank {rank}: "
            + (bytes(row[1:]).hex()[:12] if row[0] == _TABLE else names[int(row[0])])
            for rank, row in enumerate(table)]
    why = f" ({runtime._tuning_error})" if runtime._tuning_error else ""
    raise MCRDLError(
        f"ranks do not hold the same tuning table{why}: {'; '.join(rows)}; give every rank "
        f"the same file (init(tuning=...) or MCRDL_TUNING), or none"
    )
