"""Devices: streams and events, as the engine orders work on an accelerator.

A `Device` is what the engine needs of an accelerator to order work without blocking the host
(docs/design.md rule 6): streams (in-order queues of device work), events (a point in a stream,
reached once everything queued before it has run), a stream waiting on an event (device-side,
the host goes on at once), and a query of an event that never blocks. Nothing here waits.

Where they are used:
- the front records an event on the caller's current stream when an operation's buffers are on
  a device: the operation reads them only after the work the caller queued before submitting;
- each lane of a stream-ordered backend has a stream of its own (``Backend.stream``); the
  engine makes it wait on that event, and on the events of the operations it depends on, then
  starts the operation there and records the event that marks its end on the stream;
- a lane of a host backend (MPI, gloo) on device buffers starts an operation only once its
  events have been *reached*, which the engine learns by querying them as it polls;
- ``CommFuture.wait_stream`` makes a stream wait on an operation's end without blocking;
- a host backend that cannot read device memory gets host copies of an operation's device
  buffers (``host_like``), filled and read back by copies queued on a stream of its own
  (``copy``; `mcrdl.backends._staging`).

Two implementations: CUDA through torch (`mcrdl.backends._cuda`), and the simulated device of
``mcrdl.testing.SimWorld``, which runs the same engine code on CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["Device", "device_kind"]


def device_kind(device: str) -> str:
    """The kind of a device name (``"cuda:0"`` -> ``"cuda"``); what capabilities list."""
    return device.partition(":")[0]


class Device(ABC):
    """One accelerator of this process, as the engine orders work on it.

    Attributes:
        name: its name, as buffers report it (``"cuda:0"``).
        kind: its kind (``"cuda"``), what ``Capabilities.devices`` lists.
    """

    name: str
    kind: str

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream of its own (never the legacy default stream)."""

    @abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream (where the caller's own work goes)."""

    @abstractmethod
    def record(self, stream: Any) -> Any:
        """An event reached once everything queued on ``stream`` so far has run."""

    @abstractmethod
    def wait(self, stream: Any, event: Any) -> None:
        """Make work queued on ``stream`` from now on run only after ``event``; the host does
        not wait."""

    @abstractmethod
    def query(self, event: Any) -> bool:
        """Whether ``event`` has been reached; never blocks."""

    @abstractmethod
    def host_like(self, obj: Any) -> Any:
        """An uninitialized host array of ``obj``'s kind (torch tensor or numpy array), shape
        and dtype, in memory that ``copy`` moves to and from the device without the host
        waiting (pinned memory on a GPU)."""

    @abstractmethod
    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        """Queue a copy of ``src`` into ``dst`` (same shape and dtype; one on this device, the
        other from ``host_like``) on ``stream``; the host does not wait."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
