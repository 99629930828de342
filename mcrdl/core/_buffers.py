"""Buffers: what a user passes (torch tensors, numpy arrays), checked once and viewed per backend.

A `Buffer` wraps the caller's object without copying it. It knows the element type, the shape,
the device its memory is on, and the byte range it occupies (the engine's hazard tracking
orders operations that touch overlapping ranges). Backends take what they speak from it: the
address and length (the mpi backend), ``torch()`` (gloo, nccl) or ``numpy()``. Nothing is ever
converted behind the caller's back: a buffer that a backend cannot use as it is
(non-contiguous, read-only where it must be written) is refused with a message that says what
to pass instead; one on a device the chosen backend cannot reach is refused where the backend
is chosen (`mcrdl.front._select`).

Devices are named as torch names them (``"cpu"``, ``"cuda:0"``). A numpy array subclass that
reports another ``device`` (the simulated device of ``mcrdl.testing``) is taken at its word.
Another library's array in CUDA memory (cupy, numba) is taken as the torch tensor sharing its
memory (``_cuda_view``: zero-copy, not a conversion), which the operation then uses in its
place; an in-place operation still resolves to the caller's array.

torch is never imported here: a tensor can only reach us if the caller imported torch already.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, NamedTuple

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


class Buffer(NamedTuple):
    """One checked, contiguous buffer: the caller's object and what backends need of it.

    A named tuple: one is made per buffer per operation, and ``tuple.__new__`` with C-level
    field getters costs far less than a slotted object's ``__init__``.

    Attributes:
        obj: the caller's object, never a copy; ``numpy()`` and ``torch()`` share its memory.
        dtype: its element type.
        nbytes: its size in bytes.
        addr: the address of its first byte (0 when ``nbytes`` is 0). For arrays mcrdl
            allocated itself (``fresh``) it may be 0: nothing else can reference them, so
            there are no hazards to track. It is exact for every tensor.
        is_torch: a torch tensor (else a numpy array).
        fresh: allocated by mcrdl for this operation (an ``out`` the caller did not pass).
        device: where its memory lives, as torch names devices (``"cpu"``, ``"cuda:0"``).
        ranges: the byte ranges the engine tracks hazards on: none for an empty or fresh
            buffer (made with the buffer: every operation reads it).
    """

    obj: Any
    dtype: DType
    nbytes: int
    addr: int
    is_torch: bool
    fresh: bool
    device: str
    ranges: tuple[tuple[int, int], ...]

    @property
    def stop(self) -> int:
        """One past the last byte."""
        return self.addr + self.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """The buffer's shape (read from the object: most operations never need it)."""
        return tuple(self.obj.shape)

    def numpy(self) -> np.ndarray[Any, Any]:
        """A numpy view of the buffer (bfloat16 as int16 bits: data movement only)."""
        t = self.obj
        if not self.is_torch:
            return t  # type: ignore[no-any-return]
        if t.requires_grad:
            t = t.detach()
        if self.dtype is DType.BFLOAT16:
            t = t.view(sys.modules["torch"].int16)
        return t.numpy()  # type: ignore[no-any-return]

    def torch(self) -> Any:
        """A torch view of the buffer (imports torch if the caller passed numpy)."""
        if self.is_torch:
            return self.obj
        import torch

        return torch.from_numpy(self.obj)

    def row_elems(self) -> int:
        """Elements per dim-0 row."""
        n = 1
        for d in self.obj.shape[1:]:
            n *= d
        return n

    def empty(self, shape: tuple[int, ...]) -> Any:
        """A new, uninitialized object of this buffer's kind, dtype and device with ``shape``."""
        obj = self.obj
        if self.is_torch:
            torch = sys.modules["torch"]
            return torch.empty(shape, dtype=obj.dtype, device=obj.device)
        if type(obj) is np.ndarray:
            return np.empty(shape, dtype=obj.dtype)
        return np.empty_like(obj, shape=shape)  # (a subclass, and the device it reports)

    def __repr__(self) -> str:
        kind = "tensor" if self.is_torch else "ndarray"
        return (f"<Buffer {kind} {self.dtype.value}{list(self.shape)} on {self.device}"
                f" @0x{self.addr:x}>")


_new = tuple.__new__
_CPU = "cpu"
# A writable array's address through the buffer protocol: several times cheaper than reading
# it from ``__array_interface__``, which builds a dict (docs/performance-log.md, "GPU lanes on
# the CPU path, and a numpy array's address").
_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def new_buffer(obj: Any, is_torch: bool, dtype: DType, device: str = _CPU) -> Buffer:
    """A Buffer for an array mcrdl allocated itself (contiguous, unshared, on ``device``)."""
    n = obj.nbytes
    return _new(Buffer, (obj, dtype, n, obj.data_ptr() if is_torch and n else 0, is_torch, True,
                         device, ()))


def as_buffer(obj: Any, name: str, writable: bool = False) -> Buffer:
    """Check ``obj`` and wrap it; ``name`` is the argument's name for error messages.

    Raises:
        TypeError: not a torch tensor or numpy array, a sparse tensor, or a dtype mcrdl does
            not carry.
        ValueError: non-contiguous, or read-only where ``writable``.
    """
    tensor_type: Any = _tensor_type
    if tensor_type is not None and isinstance(obj, tensor_type):
        dt = _TORCH_DTYPES.get(obj.dtype)
        if dt is None or not obj.is_contiguous():
            _refuse_tensor(obj, name, dt)
        device = _CPU if obj.is_cpu else str(obj.device)
        n = obj.nbytes
        if not n:
            return _new(Buffer, (obj, dt, 0, 0, True, False, device, ()))
        addr = obj.data_ptr()
        return _new(Buffer, (obj, dt, n, addr, True, False, device, ((addr, addr + n),)))
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
        device = _CPU if type(obj) is np.ndarray else str(obj.device)
        n = obj.nbytes
        if not n:
            return _new(Buffer, (obj, dt, 0, 0, False, False, device, ()))
        addr = (_addressof(_from_buffer(obj)) if flags.writeable  # type: ignore[arg-type]
                else obj.__array_interface__["data"][0])
        return _new(Buffer, (obj, dt, n, addr, False, False, device, ((addr, addr + n),)))
    if tensor_type is None and _torch_tensor_type() is not None:
        return as_buffer(obj, name, writable)  # first tensor of the process: tables are ready
    how = _cuda_protocol(obj)
    if how is not None:
        return as_buffer(_cuda_view(obj, name, writable, how), name, writable)
    raise TypeError(
        f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__module__}."
        f"{type(obj).__qualname__}"
    )


def _cuda_protocol(obj: Any) -> str | None:
    """How ``obj``, another library's array in CUDA memory (cupy, numba, ...), can be viewed:
    ``"dlpack"`` where its ``__dlpack_device__`` says CUDA (kDLCUDA, 2), else ``"cai"``
    where it has the CUDA Array Interface (numba's arrays; managed memory); None: neither."""
    device = getattr(obj, "__dlpack_device__", None)
    if device is not None and hasattr(obj, "__dlpack__"):
        try:
            if int(device()[0]) == 2:
                return "dlpack"
        except Exception:  # noqa: BLE001 - not a usable DLPack producer: try the interface
            pass
    return "cai" if hasattr(obj, "__cuda_array_interface__") else None


def _cuda_view(obj: Any, name: str, writable: bool, how: str) -> Any:
    """The torch tensor sharing ``obj``'s CUDA memory (zero-copy), which the operation then
    uses in its place.

    Through DLPack where ``obj`` speaks it: torch passes its current stream to
    ``obj.__dlpack__``, and the producer orders that stream after the work it queued on its
    own (cupy: its current stream), so the operation reads the array only after what the
    caller's library wrote. Otherwise through the CUDA Array Interface (``torch.as_tensor``).
    """
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    cai = getattr(obj, "__cuda_array_interface__", None)
    if writable and isinstance(cai, dict) and cai.get("data", (0, False))[1]:
        raise ValueError(f"{name} is read-only but this operation writes it; pass a writable "
                         f"array")
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        why = "torch is not imported" if torch is None else "this torch sees no CUDA device"
        raise TypeError(
            f"{name} is a {kind} in CUDA memory, which mcrdl takes as the torch tensor "
            f"sharing its memory, but {why}; import a CUDA build of torch first"
        )
    try:
        view = torch.from_dlpack(obj) if how == "dlpack" else torch.as_tensor(obj)
    except Exception as exc:  # noqa: BLE001 - said with the argument's name
        raise TypeError(f"{name}: torch cannot view this {kind} in place ({exc}); pass a "
                        f"torch tensor") from exc
    if not view.is_contiguous():
        raise ValueError(
            f"{name} is not C-contiguous (shape {tuple(view.shape)}, strides in elements "
            f"{view.stride()}); pass a C-contiguous copy (cupy.ascontiguousarray({name})) — "
            f"mcrdl never copies behind your back"
        )
    return view


def _refuse_tensor(obj: Any, name: str, dt: DType | None) -> None:
    if dt is None:
        raise TypeError(
            f"{name} has dtype {obj.dtype}, which mcrdl does not carry; "
            f"supported: {', '.join(d.value for d in _TO_TORCH)}"
        )
    if str(obj.layout) != "torch.strided":  # sparse (COO, CSR...): no strides to move
        raise TypeError(
            f"{name} is a sparse tensor ({obj.layout}); mcrdl moves dense tensors only: pass "
            f"{name}.to_dense() (a sparse allreduce as torch's gloo runs it is not supported)"
        )
    raise ValueError(
        f"{name} is not contiguous (shape {tuple(obj.shape)}, strides {obj.stride()}); "
        f"pass {name}.contiguous() — mcrdl never copies behind your back"
    )
