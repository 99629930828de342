"""The simulated device: streams, events and kernels, for checking the engine's device rules on CPU.

Each rank of a `SimWorld` made with ``device=True`` has one ``SimDevice`` (``"simgpu:0"``, as
each real process has its ``"cuda:0"``). Its memory is host memory (`SimArray`: a numpy array
that reports the device), so that results can be checked directly; what is simulated is the
ordering a GPU imposes:

- a *stream* runs its items in order, on its own, whatever the host does: a user kernel
  (``launch``) runs some scheduler steps after it reaches the head (drawn from the world's
  seed), so work that is not ordered after it reads stale values;
- an *event* (``record``) is reached once everything queued before it on its stream has run;
  ``wait(stream, event)`` holds that stream's later items until then;
- a collective of a stream-ordered backend (sim semantics ``"stream"``) reaches the head of its
  stream and then occupies the stream until every member's has reached the head of theirs (as
  an NCCL kernel spins until its peers launch theirs); only then does it move data.

The world advances every device between the turns of its threads (``SimWorld.run``), as a GPU
runs while the host does something else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends import Device

if TYPE_CHECKING:
    from ._world import SimWorld

__all__ = ["SimArray", "SimDevice", "SimEvent", "SimStream"]

#: The kind of the simulated device, as ``Capabilities.devices`` lists it.
KIND = "simgpu"


class SimArray(np.ndarray):
    """A numpy array in a simulated device's memory: it reports that device (``.device``)."""

    _device: str

    def __array_finalize__(self, obj: Any) -> None:
        self._device = getattr(obj, "_device", "cpu")

    @property
    def device(self) -> str:  # type: ignore[override]
        return self._device


class SimEvent:
    """A point in a stream; ``reached`` once everything before it there has run."""

    __slots__ = ("reached",)

    def __init__(self, reached: bool = False) -> None:
        self.reached = reached

    def __repr__(self) -> str:
        return f"<SimEvent {'reached' if self.reached else 'pending'}>"


class SimStream:
    """An in-order queue of device work: ``("record", event)``, ``("wait", event)``,
    ``("kernel", fn, [steps or due step, at head])``, ``("coll", op)``."""

    __slots__ = ("name", "items")

    def __init__(self, name: str) -> None:
        self.name = name
        self.items: deque[tuple[Any, ...]] = deque()

    def __repr__(self) -> str:
        return f"<SimStream {self.name} items={len(self.items)}>"


class SimDevice(Device):
    """One rank's simulated device (see the module docstring)."""

    kind = KIND

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.name = f"{KIND}:0"
        self.rank = rank
        self._world = world
        #: The stream the rank's program queues its own work on (its "legacy default").
        self.default = SimStream("default")
        self.current = self.default
        self.streams: list[SimStream] = [self.default]

    # -- the Device contract ----------------------------------------------------------------

    def new_stream(self) -> SimStream:
        stream = SimStream(f"s{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self) -> SimStream:
        return self.current

    def record(self, stream: SimStream) -> SimEvent:
        if not stream.items:
            return SimEvent(True)
        event = SimEvent()
        stream.items.append(("record", event))
        return event

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if not event.reached:
            stream.items.append(("wait", event))

    def query(self, event: SimEvent) -> bool:
        return event.reached

    def host_like(self, obj: Any) -> np.ndarray[Any, Any]:
        host = np.empty(obj.shape, dtype=obj.dtype)
        self._world.mirror(host, obj)  # (faults injected on obj fire on its host copy)
        return host

    def copy(self, dst: Any, src: Any, stream: SimStream) -> None:
        """A kernel on ``stream`` (it runs some steps after it reaches the head, as any:
        whatever reads ``dst`` before the copy's event is reached reads stale values)."""
        self.launch(lambda: np.copyto(dst, src), stream)

    # -- what a program does with it ----------------------------------------------------------

    def array(self, values: np.ndarray[Any, Any]) -> SimArray:
        """A copy of ``values`` in this device's memory."""
        out = np.array(values).view(SimArray)
        out._device = self.name
        return out

    def launch(self, fn: Callable[[], None], stream: SimStream | None = None,
               steps: int | None = None) -> None:
        """Queue ``fn`` as a kernel on ``stream`` (default: the current stream) that runs
        ``steps`` scheduler steps after it reaches the head (default: a number drawn from
        the world's seed, up to its ``max_delay``)."""
        (stream or self.current).items.append(("kernel", fn, [steps, False]))

    def synchronize(self) -> None:
        """Block the calling (simulated) thread until the current stream has run dry."""
        event = self.record(self.current)
        while not event.reached:
            self._world.yield_()

    # -- run by the world ------------------------------------------------------------------

    def advance(self) -> bool:
        """Run every stream's head items while they can run; True if anything moved."""
        world = self._world
        moved = False
        for stream in self.streams:
            items = stream.items
            while items:
                item = items[0]
                tag = item[0]
                if tag == "wait":
                    if not item[1].reached:
                        break
                elif tag == "record":
                    item[1].reached = True
                elif tag == "kernel":
                    due = item[2]  # [steps, or the step it is due at once at the head; at head]
                    if not due[1]:
                        steps = due[0]
                        if steps is None:
                            steps = int(world.rng.integers(world.max_delay + 1))
                        due[:] = [world.step + steps, True]
                        moved = True
                    if world.step < due[0]:
                        break
                    item[1]()
                else:  # "coll": at the head; it runs once every member's is at theirs
                    op = item[1]
                    if self.rank not in op.heads:
                        op.heads.add(self.rank)
                        moved = True
                    if not world.try_execute(op):
                        break
                items.popleft()
                moved = True
        return moved

    def due(self) -> list[int]:
        """Steps at which a kernel at the head of a stream is due to run."""
        return [item[2][0] for stream in self.streams if stream.items
                for item in (stream.items[0],) if item[0] == "kernel" and item[2][1]]

    def describe(self) -> list[str]:
        """What each non-empty stream holds, head first (for deadlock reports)."""
        lines = []
        for stream in self.streams:
            if stream.items:
                heads = ", ".join(_item(i) for i in list(stream.items)[:4])
                more = f" (+{len(stream.items) - 4})" if len(stream.items) > 4 else ""
                lines.append(f"stream {stream.name}: {heads}{more}")
        return lines


def _item(item: tuple[Any, ...]) -> str:
    tag = item[0]
    if tag == "coll":
        op = item[1]
        return f"{op.kind}#{op.index} on {op.backend}:{op.gid} (waits for {op.missing_heads()})"
    if tag in ("wait", "record"):
        return f"{tag} {item[1]!r}"
    return "kernel"
