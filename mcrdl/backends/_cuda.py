"""CUDA as a `Device`: torch's streams and events on one GPU.

Every call here is asynchronous on the GPU and returns at once on the host (``query`` is
``cudaEventQuery``): the engine never waits for the device in its poll loop (docs/design.md rule 6).
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
        # torch.cuda's own stream functions (current_stream, the stream() context) check
        # their arguments and the device in Python on every call, which costs many times
        # the call underneath (docs/performance-log.md, "GPU lanes on one H200: host costs,
        # staged MPI, overlap"); every operation on device buffers asks for the current
        # stream and most switch it: these are the calls they make underneath.
        c = torch._C
        self._get_stream = c._cuda_getCurrentStream  # (stream_id, device_index, device_type)
        self._set_stream = c._cuda_setStream  # sets the device too, as torch.cuda's does
        self._get_device = c._cuda_getDevice
        self._set_device = c._cuda_setDevice
        self._streams: dict[int, Any] = {}  # Stream objects by stream id

    def new_stream(self) -> Any:
        return self._cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:
        sid, index, kind = self._get_stream(self.index)
        stream = self._streams.get(sid)
        if stream is None:
            if len(self._streams) >= 256:  # external streams come and go: keep it bounded
                self._streams.clear()
            stream = self._streams[sid] = self._cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=sid, device_index=index, device_type=kind)
        return stream

    def run_on(self, stream: Any, call: Any, *args: Any) -> Any:
        """``call(*args)`` with ``stream`` current (what ``with torch.cuda.stream(stream)``
        does), then the calling thread's current stream and device as they were."""
        device = self._get_device()
        prev = self._get_stream(self.index)
        self._set_stream(stream_id=stream.stream_id, device_index=stream.device_index,
                         device_type=stream.device_type)
        try:
            return call(*args)
        finally:
            self._set_stream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
            if device != self.index:
                self._set_device(device)

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
        self.run_on(stream, dst.copy_, src, True)  # (non_blocking)
        (src if src.is_cuda else dst).record_stream(stream)
