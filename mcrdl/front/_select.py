"""Backend selection: which backend runs an operation, as a pure function of rank-invariant facts.

Rule 4 of docs/design.md: the backend of a collective depends only on the operation, the dtype, the
kind of device its buffers are on, the global message size, the communicator size and a table
every rank holds identically, never on
local timings or per-rank sizes, so that all members pick the same backend without talking.
With a tuning table (``mcrdl.tuning``) the table's choice for the operation, dtype,
communicator size and global message size wins, where the backend is up and can run it.
Without one, or where it says nothing, the choice is the first backend in the preference order
that can run the operation on the dtype (natively, or AVG as SUM then divide) and reach the
device; for device buffers, stream-ordered backends (NCCL) come first.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends import device_kind, known_backends
from ..core._errors import BackendUnavailableError, UnknownBackendError, UnsupportedOperationError
from ..core._types import REDUCING, DType, OpKind, ReduceOp

if TYPE_CHECKING:
    from ..backends import Backend
    from ..engine import Lane
    from ..tuning import TuningTable

__all__ = ["DEFAULT_PREFERENCE", "Router", "Selector", "Slot"]

#: The built-in order for backend="auto" without a tuning table: measured on one node, MPI
#: beats gloo for every collective and size (`python -m mcrdl bench` shows it on a host;
#: docs/benchmarks.md), so it goes first.
DEFAULT_PREFERENCE = ("mpi", "gloo")


@dataclass(eq=False)
class Slot:
    """One backend as seen from one communicator: its group handle and its lane."""

    backend: Backend
    group: Any
    lane: Lane


class Router:
    """A size-dependent choice: ``pick(nbytes)`` bisects the table's range bounds."""

    __slots__ = ("bounds", "choices")

    def __init__(self, bounds: list[int], choices: list[tuple[Slot, bool]]) -> None:
        self.bounds = bounds
        self.choices = choices

    def pick(self, nbytes: int) -> tuple[Slot, bool]:
        """The (slot, emulate_avg) for a message of ``nbytes`` (global size)."""
        return self.choices[bisect_right(self.bounds, nbytes)]


def _dname(dtype: DType | None) -> str:
    return "none" if dtype is None else dtype.value


def _cannot(caps: Any, kind: OpKind, dtype: DType | None, op: ReduceOp | None,
            device: str | None = None) -> str | None:
    """Why a backend with ``caps`` cannot run this on buffers on ``device`` (None: no
    buffers), or None if it can."""
    if device is not None and device_kind(device) not in caps.devices:
        return f"cannot reach {device} (it reaches {', '.join(sorted(caps.devices))})"
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

    def __init__(self, backends: Sequence[str], preference: Sequence[str] = DEFAULT_PREFERENCE,
                 table: TuningTable | None = None):
        ordered = [b for b in preference if b in backends]
        ordered += [b for b in sorted(backends) if b not in ordered]
        self.preference = tuple(ordered)
        self.table = table

    def choose(
        self,
        slots: Mapping[str, Slot],
        kind: OpKind,
        dtype: DType | None,
        op: ReduceOp | None,
        backend: str | None,
        comm_size: int = 0,
        device: str | None = "cpu",
    ) -> tuple[Slot, bool] | Router:
        """``(slot, emulate_avg)`` for an operation on buffers on ``device`` (None: it has
        none), whatever its size; or, for
        ``backend="auto"`` with a tuning table whose choice depends on the global message
        size, a `Router` (``router.pick(nbytes)`` gives the choice).

        Raises:
            UnknownBackendError, BackendUnavailableError: a bad ``backend`` name.
            UnsupportedOperationError: the backend (or, for auto, every backend) cannot run it,
                or cannot reach the device (naming those that can).
            ValueError: AVG on an integer dtype, a bitwise op on a floating-point one.
        """
        if op is ReduceOp.AVG and dtype is not None and not dtype.is_floating:
            raise ValueError(
                f"AVG on {dtype.value} would truncate; use SUM and divide yourself, "
                "or a floating-point dtype"
            )
        if op is not None and op.is_bitwise and dtype is not None and dtype.is_floating:
            raise ValueError(
                f"{op.name} is bitwise and {dtype.value} is a floating-point dtype; bitwise "
                "reductions take integer or bool buffers (view the bits as an integer dtype "
                "of the same width if that is what you mean)"
            )
        if backend is None or backend == "auto":
            if self.table is not None:
                routed = self._routed(slots, kind, dtype, op, comm_size, device)
                if routed is not None:
                    return routed
            name = self._auto(slots, kind, dtype, op, device)
        elif type(backend) is str and backend in slots:
            name = backend
            why = _cannot(slots[name].backend.capabilities, kind, dtype, op, device)
            if why is not None:
                able = [n for n in self.preference
                        if _cannot(slots[n].backend.capabilities, kind, dtype, op, device) is None]
                raise UnsupportedOperationError(
                    f"{name} {why}; backends that can: {', '.join(able) if able else 'none'}"
                )
        elif type(backend) is not str:
            raise TypeError(f"backend must be a backend name or None, got {backend!r}")
        elif backend in self.preference:
            raise BackendUnavailableError(
                f"backend {backend!r} is not on this communicator: its survivors went on "
                f"without it after a loss (it cannot make a group once members are gone); "
                f"on it: {', '.join(n for n in self.preference if n in slots)}"
            )
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
        return slot, emulate

    def _routed(
        self, slots: Mapping[str, Slot], kind: OpKind, dtype: DType | None,
        op: ReduceOp | None, comm_size: int, device: str | None,
    ) -> tuple[Slot, bool] | Router | None:
        """The table's choice, where it has one that can run here; None: use the default."""
        route = self.table.route(  # type: ignore[union-attr]
            kind.value, _dname(dtype), comm_size, device_kind(device or "cpu"))
        if route is None:
            return None
        bounds, names = route
        choices = []
        for name in names:
            # A choice this runtime cannot honour (a backend not up, or not able to run this
            # dtype) falls back to the default rule: capabilities first, the same everywhere.
            if name not in slots or _cannot(slots[name].backend.capabilities, kind, dtype, op,
                                            device):
                name = self._auto(slots, kind, dtype, op, device)
            slot = slots[name]
            emulate = op is ReduceOp.AVG and ReduceOp.AVG not in slot.backend.capabilities.reductions
            choices.append((slot, emulate))
        if len({id(c[0]) for c in choices}) == 1:
            return choices[0]
        return Router(bounds, choices)

    def _auto(
        self, slots: Mapping[str, Slot], kind: OpKind, dtype: DType | None, op: ReduceOp | None,
        device: str | None = None,
    ) -> str:
        order = self.preference
        if device is not None and device_kind(device) != "cpu":
            # Device buffers: a backend that orders its work on the device's streams first
            # (NCCL and its kind never make the host wait), in the preference order.
            order = tuple(sorted(order, key=lambda n: n not in slots
                                 or not slots[n].backend.capabilities.stream_ordered))
        for name in order:
            if name in slots and _cannot(slots[name].backend.capabilities, kind, dtype, op,
                                         device) is None:
                return name
        what = kind.value + (f" {dtype.value}" if dtype is not None else "")
        if op is not None and kind in REDUCING:
            what += f" with {op.name}"
        if device is not None and device_kind(device) != "cpu":
            what += f" on {device}"
        raise UnsupportedOperationError(
            f"no backend in this runtime can {what} (tried: {', '.join(self.preference)})"
        )
