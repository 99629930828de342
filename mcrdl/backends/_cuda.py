"""CUDA as a `Device`: torch's streams and events on one GPU.

Every call here is asynchronous on the GPU and returns at once on the host (``query`` is
``cudaEventQuery``): the engine never waits for the device in its poll loop (DESIGN.md rule 6).
torch is imported by the backend that makes the device, never by ``import mcrdl``.
"""

from __future__ import annotations

from typing import Any

from ._device import Device

__all__ = ["CudaDevice"]


class CudaDevice(Device):
    """GPU ``index`` of this process, through ``torch.cuda``."""

    kind = "cuda"

    def __init__(self, index: int) -> None:
        import torch

        self._torch = torch
        self._cuda = torch.cuda
        self.index = index
        self.name = f"cuda:{index}"
        self._device = torch.device("cuda", index)

    def new_stream(self) -> Any:
        return self._cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:
        return self._cuda.current_stream(self._device)

    def record(self, stream: Any) -> Any:
        event = self._cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def host_like(self, obj: Any) -> Any:
        return self._torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        # The staged request holds both tensors until an event after the copy is reached; the
        # device one is also recorded on the copy stream, so that the caching allocator does
        # not hand its memory out before the copy has run even if the request is dropped
        # first (cancelled while its copy was queued). Pinned host memory is kept by torch's
        # host allocator until the copies that use it have run.
        # (detached: a parameter's gradient has nothing to do with its bytes moving)
        dst, src = dst.detach(), src.detach()
        with self._cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        (src if src.is_cuda else dst).record_stream(stream)
