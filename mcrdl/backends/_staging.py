"""Host backends on device buffers: each operation staged through host copies.

A host backend that cannot read device memory (MPI built without CUDA support, gloo) reaches
it through `StagedBackend`, which the runtime wraps around it when the process has a device
(docs/design.md rule 6; docs/gpu.md). A host backend that reaches the device kind for most
operations (``Capabilities.direct``: a CUDA-aware MPI) is wrapped too: its operations on device
buffers are handed to it as they are, and only those it runs in host memory
(``Backend.host_only``: MPI's half-precision reductions) are staged. Those handed over keep
their place in the group's order like any other (below). An operation on device buffers gets a host array per device
buffer (``Device.host_like``: pinned memory on a GPU). Its inputs are copied there on a copy
stream of the adapter's own; the host backend's call is made on the host arrays once the event
recorded after those copies has been reached; once the backend reports the call finished,
its outputs are copied back on the same stream, and the operation is finished when the event
recorded after them has been reached. The engine sees one request, tested like any other: the
events are queried, never waited for.

Why this cannot hang:
- the engine starts an operation of a host lane on device buffers only once the caller's
  stream has reached the operation's event and its dependencies have finished (its gate), so
  the data is in place when the copies are queued: the copy stream never waits on an event,
  and everything queued there runs whatever the peers do;
- per group, the host backend's calls are made in the order the engine started the operations
  (the order the peers match them in): an operation started while an earlier one of its
  group still waits for its copies waits behind it, one on host buffers too.

Which buffers are copied which way (`_roles`): the first buffer of an operation is its input
(except a receive's, and a broadcast's off the root) and is copied in; a receive's buffer, an
allreduce's, a broadcast's off the root, a reduce's at the root, and every second buffer (an
``out``) are outputs, copied back. Empty buffers get empty host arrays and no copies.

Failures: a host call that raises fails its operation as a start that failed (at once when
the call is made as the operation starts, else when it is next tested), and no later call of
its group is made: those operations fail with StartError too, as a blocking backend's worker
does (rule 7). An operation whose host call is still to be made is never cancelled: the ones
queued behind it would be made in its place.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..core._buffers import Buffer, new_buffer
from ..core._errors import BackendError, StartError
from ..core._types import OpKind
from ._contract import Backend, Capabilities, Group, Request
from ._device import Device

__all__ = ["Staged", "StagedBackend"]

# A staged request's states, in order.
QUEUED, RUNNING, COPY_BACK, FINISHED = range(4)
_STATES = ("waiting for its copies from the device", "running", "copying its result back",
           "finished")


class Staged:
    """One operation of a `StagedBackend`: its host call, and the copies around it.

    Invariants: ``state`` only advances; while QUEUED the request is in its group's queue and
    ``event`` (None: nothing to copy in) marks the end of its copies in; while RUNNING
    ``request`` is the host backend's (None: it finished during its start); while COPY_BACK
    ``event`` marks the end of the copies back. ``keep`` holds the host arrays and the device
    buffers until FINISHED (the host backend may hold only their addresses).
    """

    __slots__ = ("group", "start", "args", "device", "event", "back", "keep", "request",
                 "state", "error")

    def __init__(self, group: Any, start: Callable[..., Request], args: tuple[Any, ...],
                 device: Device | None, event: Any,
                 back: list[tuple[Any, Any]], keep: list[Any]) -> None:
        self.group = group
        self.start = start
        self.args = args
        self.device = device
        self.event = event
        #: (device array, host array) pairs copied back once the host call has finished.
        self.back = back
        self.keep = keep
        self.request: Request = None
        self.state = QUEUED
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"<staged {getattr(self.start, '__name__', 'call')} {_STATES[self.state]}>"


def _roles(op: str, index: int, group: Group, args: tuple[Any, ...]) -> tuple[bool, bool]:
    """Whether the device buffer at ``args[index]`` (``args``: a start's arguments after its
    group) is read (copied in) and written (copied back) by ``op`` on this rank."""
    if index > 0 or op == "recv":  # an out, or what a receive fills
        return False, True
    if op == "broadcast":
        root = args[1] == group.rank
        return root, not root
    if op == "reduce":
        return True, args[1] == group.rank
    return True, op == "allreduce"


def _make_start(op: str) -> Callable[..., Request]:
    name = f"start_{op}"
    kind = OpKind(op)

    def start(self: StagedBackend, group: Any, *args: Any) -> Request:
        on_device = [i for i, a in enumerate(args) if type(a) is Buffer and a.device != "cpu"]
        if on_device and self._direct and self._in_place(kind, args, on_device[0]):
            on_device = []  # the host backend reaches them itself: handed over as they are
        queue = self._queues.get(group)
        if not on_device and not queue and group not in self._failed:
            return getattr(self.inner, name)(group, *args)  # nothing to copy or wait behind
        return self._stage(op, getattr(self.inner, name), group, args, on_device)

    start.__name__ = name
    start.__doc__ = f"``{op}`` on the host backend, its device buffers staged."
    return start


class StagedBackend(Backend):
    """``inner``, a host backend, reaching ``devices`` through host copies (module docstring).

    Everything but the starts and the tests of requests is ``inner``'s own.
    """

    def __init__(self, inner: Backend, devices: Mapping[str, Device]) -> None:  # noqa: D107
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.device = inner.device
        caps = inner.capabilities
        kinds = frozenset(d.kind for d in devices.values()) - caps.devices
        #: The kinds ``inner`` reaches in place for all but its ``host_only`` operations.
        self._direct = kinds & caps.direct
        self.capabilities: Capabilities = replace(caps, devices=caps.devices | kinds,
                                                  staged=caps.staged | (kinds - self._direct))
        self._devices = {name: d for name, d in devices.items() if d.kind in kinds}
        self._streams: dict[str, Any] = {}
        #: Per group, the started operations whose host call is not made yet, in order.
        self._queues: dict[Any, deque[Staged]] = {}
        #: Per group, why a host call failed (none is made after it).
        self._failed: dict[Any, BaseException] = {}
        #: Staged requests not yet reported finished (0: every request is the host's own).
        self._live = 0

    def __getattr__(self, name: str) -> Any:  # what only the host backend has (memory_kinds)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @classmethod
    def is_available(cls) -> bool:
        return True

    # -- groups: the host backend's -------------------------------------------------------

    def world(self) -> Any:
        return self.inner.world()

    def create_group(self, parent: Any, members: Sequence[int], tag: str) -> Any:
        return self.inner.create_group(parent, members, tag)

    def regroup(self, parent: Any, members: Sequence[int], tag: str, store: Any) -> Any:
        return self.inner.regroup(parent, members, tag, store)

    def free_group(self, group: Any) -> None:
        if not self._queues.get(group):  # (operations given up on may still be queued)
            self._queues.pop(group, None)
            self._failed.pop(group, None)
        self.inner.free_group(group)

    def abandon(self, group: Any) -> None:
        self.inner.abandon(group)

    def close(self) -> None:
        self.inner.close()

    # -- staging ----------------------------------------------------------------------------

    def _stage(self, op: str, start: Callable[..., Request], group: Any,
               args: tuple[Any, ...], on_device: list[int]) -> Staged:
        """Queue ``start(group, *args)`` behind its group's earlier staged operations, with
        host arrays in place of the device buffers at ``on_device`` (inputs copied there)."""
        host_args = list(args)
        back: list[tuple[Any, Any]] = []
        keep: list[Any] = []
        device: Device | None = None
        event = None
        if on_device:
            copied_in = False
            # (the front made sure that an operation's buffers share one device)
            device = self._device(args[on_device[0]].device)
            stream = self._stream(device)
            for i in on_device:
                buf: Buffer = args[i]
                host = device.host_like(buf.obj)  # (an empty one too: backends compare devices)
                host_args[i] = new_buffer(host, buf.is_torch, buf.dtype)
                if not buf.nbytes:
                    continue
                keep.append((buf.obj, host))
                read, written = _roles(op, i, group, args)
                if read:
                    device.copy(host, buf.obj, stream)
                    copied_in = True
                if written:
                    back.append((buf.obj, host))
            if copied_in:
                event = device.record(stream)
        staged = Staged(group, start, (group, *host_args), device, event, back, keep)
        queue = self._queues.get(group)
        if queue is None:
            queue = self._queues[group] = deque()
        queue.append(staged)
        self._live += 1
        self._advance(group)
        if staged.error is not None:  # its own host call failed now: the engine hears at once
            self._release(staged)
            raise staged.error
        return staged

    def _in_place(self, op: OpKind, args: tuple[Any, ...], first: int) -> bool:
        """Whether ``op``'s device buffers (``args[first]`` the first) go to the host backend
        as they are: their kind is one it reaches (``capabilities.direct``) and the operation
        is not one it runs in host memory only (``host_only``)."""
        device = self._device(args[first].device)
        return device.kind in self._direct and not self.inner.host_only(op, args)

    def _device(self, name: str) -> Device:
        device = self._devices.get(name)
        if device is None:
            raise ValueError(
                f"{self.name} reaches {', '.join(sorted(self._devices))} through host copies, "
                f"not {name}; pass buffers on {' or '.join(sorted(self._devices))}")
        return device

    def _stream(self, device: Device) -> Any:
        stream = self._streams.get(device.name)
        if stream is None:
            stream = self._streams[device.name] = device.new_stream()
        return stream

    def _may_start(self, staged: Staged) -> bool:
        """Whether ``staged``'s inputs are in its host arrays."""
        return staged.event is None or staged.device.query(staged.event)  # type: ignore[union-attr]

    def _copied_back(self, staged: Staged) -> bool:
        """Whether ``staged``'s outputs are back in device memory."""
        return staged.device.query(staged.event)  # type: ignore[union-attr]

    def _advance(self, group: Any) -> None:
        """Make the host calls of the group's queued operations, in order, while the head's
        inputs are in place. After a call that raised, make no more: the peers would match
        the next in its place (rule 7); they fail with StartError instead."""
        queue = self._queues[group]
        while queue and self._may_start(queue[0]):
            staged = queue.popleft()
            staged.state = RUNNING
            failed = self._failed.get(group)
            if failed is not None:
                staged.error = StartError(f"not started: an earlier operation of its group "
                                          f"failed to start ({failed})")
                continue
            try:
                staged.request = staged.start(*staged.args)
            except Exception as exc:  # noqa: BLE001 - reported by test, as a start that failed
                staged.error = StartError(f"{self.name}: {exc}")
                staged.error.__cause__ = exc
                self._failed[group] = staged.error
            staged.start = staged.args = None  # type: ignore[assignment]

    def _step(self, staged: Staged) -> bool:
        """Move ``staged`` on as far as it can go now; True once finished.

        Raises:
            BackendError, StartError: the host call failed.
        """
        if staged.state == QUEUED:
            self._advance(staged.group)
            if staged.state == QUEUED:
                return False
        if staged.state == RUNNING:
            if staged.error is None and staged.request is not None:
                done = self.inner.test([staged.request])
                if not done:
                    return False
                staged.error = done[0][1]
            staged.request = None
            if staged.error is not None or not staged.back:
                return self._finish(staged)
            try:
                stream = self._stream(staged.device)  # type: ignore[arg-type]
                for dev, host in staged.back:
                    staged.device.copy(dev, host, stream)  # type: ignore[union-attr]
                staged.event = staged.device.record(stream)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - the operation's failure, reported
                staged.error = BackendError(f"{self.name}: copying the result back to "
                                            f"{staged.device.name} failed: {exc}")  # type: ignore[union-attr]
                staged.error.__cause__ = exc
                return self._finish(staged)
            staged.state = COPY_BACK
        if staged.state == COPY_BACK and not self._copied_back(staged):
            return False
        return self._finish(staged)

    def _finish(self, staged: Staged) -> bool:
        """``staged`` has finished: True, or its host call's error raised."""
        self._release(staged)
        if staged.error is not None:
            raise staged.error
        return True

    def _release(self, staged: Staged) -> None:
        """Let go of ``staged``'s arrays (nothing uses them any more)."""
        if staged.state != FINISHED:
            staged.state = FINISHED
            staged.keep = staged.back = []
            self._live -= 1

    # -- requests -------------------------------------------------------------------------

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        if not self._live:
            return self.inner.test(requests)
        out: list[tuple[int, BaseException | None]] = []
        plain: list[int] = []
        for i, req in enumerate(requests):
            if type(req) is not Staged:
                plain.append(i)
                continue
            try:
                if self._step(req):
                    out.append((i, None))
            except Exception as exc:  # noqa: BLE001 - the operation's failure, reported
                out.append((i, exc))
        if plain:
            done = self.inner.test([requests[i] for i in plain])
            out.extend((plain[j], err) for j, err in done)
        return out

    def test_one(self, request: Request) -> bool:
        if type(request) is Staged:
            return self._step(request)
        return self.inner.test_one(request)

    def block(self, request: Request, timeout: float) -> bool:
        if type(request) is not Staged:
            return self.inner.block(request, timeout)
        inner = request.request
        if request.state == RUNNING and inner is not None:
            self.inner.block(inner, timeout)
        else:  # copies (short): let the backend's threads run while the caller polls
            time.sleep(0)
        return False

    def cancel(self, request: Request) -> bool:
        if type(request) is not Staged:
            return self.inner.cancel(request)
        # Not while its host call is still to be made: the operations queued behind it would
        # then be made in its place, where the peers match it. Its host call is made (the
        # copies always finish), as for an operation the host backend cannot cancel.
        if request.state == RUNNING and request.request is not None:
            if self.inner.cancel(request.request):
                self._release(request)
                return True
        return False

    def describe_wait(self, request: Request) -> str | None:
        if type(request) is not Staged:
            return self.inner.describe_wait(request)
        if request.state == RUNNING and request.request is not None:
            return self.inner.describe_wait(request.request)
        return f"it is {_STATES[request.state]} (staged through host memory)"

    def thread_held(self, request: Request) -> Any:
        if type(request) is not Staged:
            return self.inner.thread_held(request)
        if request.state == RUNNING and request.request is not None:
            return self.inner.thread_held(request.request)
        return None


for _kind in OpKind:
    setattr(StagedBackend, f"start_{_kind.value}", _make_start(_kind.value))
StagedBackend.__abstractmethods__ = frozenset()
