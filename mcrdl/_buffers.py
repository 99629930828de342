"""Buffers: what a user passes (torch CPU tensors, numpy arrays), checked once and viewed per backend.

A `Buffer` wraps the caller's object without copying it. It knows the element type, the shape,
and the byte range the object occupies (the engine's hazard tracking orders operations that
touch overlapping ranges). Backends take what they speak from it: the address and length
(the mpi backend), ``torch()`` (gloo) or ``numpy()``. Nothing is ever converted behind the caller's back: a buffer
that a backend cannot use as it is (non-contiguous, on another device, read-only where it must be
written) is refused with a message that says what to pass instead.

torch is never imported here: a tensor can only reach us if the caller imported torch already.
"""

from __future__ import annotations

import sys
from operator import itemgetter
from typing import Any

import numpy as np

from ._types import DType

__all__ = ["Buffer", "as_buffer", "new_buffer"]

_NUMPY_DTYPES: dict[np.dtype[Any], DType] = {
    np.dtype(name): dt for dt in DType if (name := dt.value) != "bfloat16"
}
_TORCH_DTYPES: dict[Any, DType] = {}
_TO_TORCH: dict[DType, Any] = {}


def _torch_tables() -> None:
    torch = sys.modules["torch"]
    for dt in DType:
        tdt = getattr(torch, dt.value, None)
        if tdt is not None:
            _TORCH_DTYPES[tdt] = dt
            _TO_TORCH[dt] = tdt


_tensor_type: type | None = None


def _torch_tensor_type() -> type | None:
    """torch.Tensor once the caller has imported torch (and the dtype tables with it)."""
    global _tensor_type
    if _tensor_type is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            if not _TORCH_DTYPES:
                _torch_tables()
            _tensor_type = torch.Tensor
    return _tensor_type


class Buffer(tuple):  # type: ignore[type-arg]
    """One checked, contiguous, host-memory buffer and its views.

    A tuple underneath: it is made for every operation, and ``tuple.__new__`` with C-level
    field getters costs a third of a slotted object's ``__init__``.

    Invariants:
    - ``obj`` is the caller's object, never a copy; ``numpy()`` and ``torch()`` share its memory.
    - ``start`` is the address of the first byte (0 when ``nbytes`` is 0); for arrays mcrdl
      allocated itself (``fresh``) it may be 0, since nothing else can reference them and so
      there are no hazards to track. ``start`` is exact for every tensor.
    """

    __slots__ = ()

    obj: Any = property(itemgetter(0))
    dtype: DType = property(itemgetter(1))  # type: ignore[assignment]
    nbytes: int = property(itemgetter(2))  # type: ignore[assignment]
    start: int = property(itemgetter(3))  # type: ignore[assignment]
    is_torch: bool = property(itemgetter(4))  # type: ignore[assignment]
    fresh: bool = property(itemgetter(5))  # type: ignore[assignment]

    @property
    def stop(self) -> int:
        """One past the last byte."""
        return self[3] + self[2]  # type: ignore[no-any-return]

    @property
    def shape(self) -> tuple[int, ...]:
        """The buffer's shape (read from the object: most operations never need it)."""
        return tuple(self[0].shape)

    def numpy(self) -> np.ndarray[Any, Any]:
        """A numpy view of the buffer (bfloat16 as int16 bits: data movement only)."""
        t = self[0]
        if not self[4]:
            return t  # type: ignore[no-any-return]
        if t.requires_grad:
            t = t.detach()
        if self[1] is DType.BFLOAT16:
            t = t.view(sys.modules["torch"].int16)
        return t.numpy()  # type: ignore[no-any-return]

    def torch(self) -> Any:
        """A torch view of the buffer (imports torch if the caller passed numpy)."""
        if self[4]:
            return self[0]
        import torch

        return torch.from_numpy(self[0])

    def row_elems(self) -> int:
        """Elements per dim-0 row."""
        n = 1
        for d in self[0].shape[1:]:
            n *= d
        return n

    def empty(self, shape: tuple[int, ...]) -> Any:
        """A new, uninitialized object of this buffer's kind and dtype with ``shape``."""
        if self[4]:
            torch = sys.modules["torch"]
            return torch.empty(shape, dtype=self[0].dtype)
        return np.empty(shape, dtype=self[0].dtype)

    def __repr__(self) -> str:
        kind = "tensor" if self[4] else "ndarray"
        return f"<Buffer {kind} {self[1].value}{list(self.shape)} @0x{self[3]:x}>"


_new = tuple.__new__


def new_buffer(obj: Any, is_torch: bool, dtype: DType) -> Buffer:
    """A Buffer for an array mcrdl allocated itself (contiguous, host memory, unshared)."""
    n = obj.nbytes
    return _new(Buffer, (obj, dtype, n, obj.data_ptr() if is_torch and n else 0, is_torch, True))


def as_buffer(obj: Any, name: str, writable: bool = False) -> Buffer:
    """Check ``obj`` and wrap it; ``name`` is the argument's name for error messages.

    Raises:
        TypeError: not a torch tensor or numpy array, or a dtype mcrdl does not carry.
        ValueError: non-contiguous, not in host memory, or read-only where ``writable``.
    """
    tensor_type: Any = _tensor_type
    if tensor_type is not None and isinstance(obj, tensor_type):
        dt = _TORCH_DTYPES.get(obj.dtype)
        if dt is None or not obj.is_cpu or not obj.is_contiguous():
            _refuse_tensor(obj, name, dt)
        n = obj.nbytes
        return _new(Buffer, (obj, dt, n, obj.data_ptr() if n else 0, True, False))
    if isinstance(obj, np.ndarray):
        dt = _NUMPY_DTYPES.get(obj.dtype)
        if dt is None:
            raise TypeError(
                f"{name} has numpy dtype {obj.dtype.str!r}, which mcrdl does not carry; "
                f"supported: {', '.join(d.value for d in _NUMPY_DTYPES.values())} "
                "(native byte order)"
            )
        flags = obj.flags
        if not flags.c_contiguous:
            raise ValueError(
                f"{name} is not C-contiguous (shape {obj.shape}, strides {obj.strides}); "
                f"pass np.ascontiguousarray({name}) — mcrdl never copies behind your back"
            )
        if writable and not flags.writeable:
            raise ValueError(f"{name} is read-only but this operation writes it; pass a writable array")
        n = obj.nbytes
        return _new(Buffer, (obj, dt, n, obj.__array_interface__["data"][0] if n else 0,
                             False, False))
    if tensor_type is None and _torch_tensor_type() is not None:
        return as_buffer(obj, name, writable)  # first tensor of the process: tables are ready
    raise TypeError(
        f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__module__}."
        f"{type(obj).__qualname__}"
    )


def _refuse_tensor(obj: Any, name: str, dt: DType | None) -> None:
    if dt is None:
        raise TypeError(
            f"{name} has dtype {obj.dtype}, which mcrdl does not carry; "
            f"supported: {', '.join(d.value for d in _TO_TORCH)}"
        )
    if not obj.is_cpu:
        raise ValueError(
            f"{name} is on device {obj.device}, which the CPU backends cannot reach; "
            f"pass {name}.cpu() or use a GPU backend"
        )
    raise ValueError(
        f"{name} is not contiguous (shape {tuple(obj.shape)}, strides {obj.stride()}); "
        f"pass {name}.contiguous() — mcrdl never copies behind your back"
    )
