"""Backend selection: which backend runs an operation, as a pure function of rank-invariant facts.

Rule 4 of DESIGN.md: the backend of a collective depends only on the operation, the dtype, the
global message size, the communicator size and a table every rank holds identically, never on
local timings or per-rank sizes, so that all members pick the same backend without talking.
Without a tuning table the choice is the first backend in the preference order that can run
the operation on the dtype (natively, or AVG as SUM then divide).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import BackendUnavailableError, UnknownBackendError, UnsupportedOperationError
from ._types import REDUCING, DType, OpKind, ReduceOp
from .backends import known_backends

if TYPE_CHECKING:
    from .backends import Backend
    from .engine import Lane

__all__ = ["DEFAULT_PREFERENCE", "Selector", "Slot"]

#: The built-in order for backend="auto" without a tuning table: measured on one node, MPI
#: beats gloo for every collective and size (MACHINE-NOTES.md), so it goes first.
DEFAULT_PREFERENCE = ("mpi", "gloo")


@dataclass(eq=False)
class Slot:
    """One backend as seen from one communicator: its group handle and its lane."""

    backend: Backend
    group: Any
    lane: Lane


def _cannot(caps: Any, kind: OpKind, dtype: DType | None, op: ReduceOp | None) -> str | None:
    """Why a backend with ``caps`` cannot run this, or None if it can."""
    if kind not in caps.ops:
        return f"cannot {kind.value}"
    if dtype is not None and dtype not in caps.dtypes:
        return f"cannot carry {dtype.value}"
    if op is not None and dtype is not None and not caps.can_reduce(op, dtype):
        return f"cannot reduce {dtype.value} with {op.name}"
    return None


class Selector:
    """Chooses a slot per operation; the runtime owns one.

    Invariants:
    - ``preference`` lists the runtime's backends in the order auto tries them.
    """

    def __init__(self, backends: Sequence[str], preference: Sequence[str] = DEFAULT_PREFERENCE):
        ordered = [b for b in preference if b in backends]
        ordered += [b for b in sorted(backends) if b not in ordered]
        self.preference = tuple(ordered)

    def choose(
        self,
        slots: Mapping[str, Slot],
        kind: OpKind,
        dtype: DType | None,
        op: ReduceOp | None,
        nbytes: int,
        backend: str | None,
    ) -> tuple[tuple[Slot, bool], bool]:
        """``((slot, emulate_avg), cacheable)`` for one operation.

        Raises:
            UnknownBackendError, BackendUnavailableError: a bad ``backend`` name.
            UnsupportedOperationError: the backend (or, for auto, every backend) cannot run it.
            ValueError: AVG on an integer dtype.
        """
        if op is ReduceOp.AVG and dtype is not None and not dtype.is_floating:
            raise ValueError(
                f"AVG on {dtype.value} would truncate; use SUM and divide yourself, "
                "or a floating-point dtype"
            )
        if backend is None or backend == "auto":
            name = self._auto(slots, kind, dtype, op)
        elif type(backend) is str and backend in slots:
            name = backend
            why = _cannot(slots[name].backend.capabilities, kind, dtype, op)
            if why is not None:
                able = [n for n in self.preference
                        if _cannot(slots[n].backend.capabilities, kind, dtype, op) is None]
                raise UnsupportedOperationError(
                    f"{name} {why}; backends that can: {', '.join(able) if able else 'none'}"
                )
        elif type(backend) is not str:
            raise TypeError(f"backend must be a backend name or None, got {backend!r}")
        elif backend in known_backends():
            raise BackendUnavailableError(
                f"backend {backend!r} is not available in this runtime; available: "
                f"{', '.join(self.preference)}"
            )
        else:
            raise UnknownBackendError(
                f"unknown backend {backend!r}; known: {', '.join(known_backends())}"
            )
        slot = slots[name]
        caps = slot.backend.capabilities
        emulate = op is ReduceOp.AVG and ReduceOp.AVG not in caps.reductions
        return (slot, emulate), True

    def _auto(
        self, slots: Mapping[str, Slot], kind: OpKind, dtype: DType | None, op: ReduceOp | None
    ) -> str:
        for name in self.preference:
            if name in slots and _cannot(slots[name].backend.capabilities, kind, dtype, op) is None:
                return name
        what = kind.value + (f" {dtype.value}" if dtype is not None else "")
        if op is not None and kind in REDUCING:
            what += f" with {op.name}"
        raise UnsupportedOperationError(
            f"no backend in this runtime can {what} (tried: {', '.join(self.preference)})"
        )
