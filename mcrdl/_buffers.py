"""Buffers: what a user passes (torch CPU tensors, numpy arrays), checked once and viewed per backend.

A `Buffer` wraps the caller's object without copying it. It knows the element type, the shape,
and the byte range the object occupies (the engine's hazard tracking orders operations that
touch overlapping ranges). Backends ask it for the view they speak: ``numpy()`` for mpi4py,
``torch()`` for torch.distributed. Nothing is ever converted behind the caller's back: a buffer
that a backend cannot use as it is (non-contiguous, on another device, read-only where it must be
written) is refused with a message that says what to pass instead.

torch is never imported here: a tensor can only reach us if the caller imported torch already.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._types import DType

__all__ = ["Buffer", "as_buffer", "dtype_of_torch"]

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


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


def dtype_of_torch(tdtype: Any) -> DType | None:
    """The DType of a torch dtype, or None for one mcrdl does not carry (complex32, float8...)."""
    if not _TORCH_DTYPES:
        _torch_tables()
    return _TORCH_DTYPES.get(tdtype)


class Buffer:
    """One checked, contiguous, host-memory buffer and its views.

    Invariants:
    - ``obj`` is the caller's object, never a copy; ``numpy()`` and ``torch()`` share its memory.
    - ``start``/``stop`` bound the bytes ``obj`` occupies; ``stop == start`` for an empty buffer.
    """

    __slots__ = ("obj", "dtype", "shape", "numel", "nbytes", "start", "stop", "is_torch", "_np")

    obj: Any
    dtype: DType
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    start: int
    stop: int
    is_torch: bool

    def numpy(self) -> np.ndarray[Any, Any]:
        """A numpy view of the buffer (bfloat16 as int16 bits: data movement only)."""
        view = self._np
        if view is None:
            t = self.obj
            if t.requires_grad:
                t = t.detach()
            if self.dtype is DType.BFLOAT16:
                t = t.view(sys.modules["torch"].int16)
            view = self._np = t.numpy()
        return view

    def torch(self) -> Any:
        """A torch view of the buffer (imports torch if the caller passed numpy)."""
        if self.is_torch:
            return self.obj
        import torch

        return torch.from_numpy(self.obj)

    def rows(self) -> int:
        """Length of dim 0 (the dimension that gather, scatter and alltoall split)."""
        return self.shape[0]

    def row_elems(self) -> int:
        """Elements per dim-0 row."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    def empty(self, shape: tuple[int, ...]) -> Any:
        """A new, uninitialized object of this buffer's kind and dtype with ``shape``."""
        if self.is_torch:
            torch = sys.modules["torch"]
            return torch.empty(shape, dtype=self.obj.dtype)
        return np.empty(shape, dtype=self.obj.dtype)

    def __repr__(self) -> str:
        kind = "tensor" if self.is_torch else "ndarray"
        return f"<Buffer {kind} {self.dtype.value}{list(self.shape)} @0x{self.start:x}>"


def as_buffer(obj: Any, name: str, *, writable: bool = False) -> Buffer:
    """Check ``obj`` and wrap it; ``name`` is the argument's name for error messages.

    Raises:
        TypeError: not a torch tensor or numpy array, or a dtype mcrdl does not carry.
        ValueError: non-contiguous, not in host memory, or read-only where ``writable``.
    """
    b = Buffer.__new__(Buffer)
    b.obj = obj
    b._np = None
    if type(obj) is np.ndarray or isinstance(obj, np.ndarray):
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
        b.dtype = dt
        b.shape = obj.shape
        b.numel = obj.size
        b.nbytes = n = obj.nbytes
        b.start = start = obj.__array_interface__["data"][0] if n else 0
        b.stop = start + n
        b.is_torch = False
        b._np = obj
        return b
    tensor_type = _torch_tensor_type()
    if tensor_type is None or not isinstance(obj, tensor_type):
        raise TypeError(
            f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__module__}."
            f"{type(obj).__qualname__}"
        )
    if not _TORCH_DTYPES:
        _torch_tables()
    dt = _TORCH_DTYPES.get(obj.dtype)
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
    if not obj.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(obj.shape)}, strides {obj.stride()}); "
            f"pass {name}.contiguous() — mcrdl never copies behind your back"
        )
    b.dtype = dt
    b.shape = obj.shape
    b.numel = obj.numel()
    b.nbytes = n = obj.nbytes
    b.start = start = obj.data_ptr() if n else 0
    b.stop = start + n
    b.is_torch = True
    return b
