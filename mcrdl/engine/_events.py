"""Device work ordered by events (rule 6 of docs/design.md), never by a host wait in a poll.

An operation on device buffers carries the event of the caller's current stream at submission
(``fut.waits``). On a lane with a stream (a stream-ordered backend), the lane's stream waits on
that event and the operation is queued there; the event recorded after it (``fut.event``)
marks its end. A dependency between two such operations on one device is met when the first
is *queued*: the second's stream waits on the first's event (``_enqueued``). Every other
dependency is met when the first has finished, as seen by the host; and an operation of a host
lane (MPI, gloo) on device buffers is issued only once the engine has seen its events reached
(its *gate*, queried as it polls).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..core._errors import DependencyFailedError
from ._states import DONE, ISSUED, PENDING, STATE_NAMES

if TYPE_CHECKING:
    from ._future import CommFuture
    from ._lanes import CommState

__all__ = ["Events"]


class Events:
    """The engine's device ordering (a part of `Engine`, with its lock held but for
    ``_caller_event``)."""

    if not TYPE_CHECKING:  # (the engine declares the slots: it has no __dict__)
        __slots__ = ()

    _gated: list[CommFuture]
    _work: deque[tuple[CommFuture, BaseException | None]]

    def _caller_event(self, fut: CommFuture) -> None:
        """``fut`` runs after the work the caller queued on its current stream so far."""
        device = fut.device
        fut.waits = [device.record(device.current_stream())]

    @staticmethod
    def _stream_edge(fut: CommFuture, dep: CommFuture) -> bool:
        """Whether ``fut`` may wait for ``dep`` on its stream, once ``dep`` is queued,
        instead of for ``dep``'s end on the host: both run on streams of one device, and all
        of ``dep`` runs there (no finishing step on the host)."""
        return (fut.lane.stream is not None and dep.lane.stream is not None
                and dep.lane.device is fut.lane.device and dep.finish is None)

    def _edge_event(self, fut: CommFuture, dep: CommFuture) -> None:
        """``fut``'s stream is to wait for the queued ``dep``'s end."""
        if fut.waits is None:
            fut.waits = [dep.event]
        else:
            fut.waits.append(dep.event)
        dep_list = dep._on_stream
        if dep_list is None:
            dep._on_stream = [fut]
        else:
            dep_list.append(fut)

    def _on_device(self, fut: CommFuture, deps: dict[CommFuture, None]
                   ) -> dict[CommFuture, None]:
        """``deps`` without those ``fut``'s stream can wait for already (queued on a stream
        of its device): their events join ``fut.waits``."""
        kept: dict[CommFuture, None] = {}
        for dep in deps:
            if dep._state == ISSUED and self._stream_edge(fut, dep):
                self._edge_event(fut, dep)
            else:
                kept[dep] = None
        return kept

    def _enqueued(self, fut: CommFuture) -> None:
        """``fut`` was queued on its lane's stream: its dependants that can wait for it on
        their own streams (`_stream_edge`) go on, their streams waiting on ``fut.event``."""
        keep = []
        for dep in fut._dependants:  # type: ignore[union-attr]
            if (dep._state == PENDING and dep._placement is None
                    and self._stream_edge(dep, fut)):
                self._edge_event(dep, fut)
                self._dep_done(dep)
            else:
                keep.append(dep)
        fut._dependants = keep or None

    def _open_gates(self) -> bool:
        """Let the gated operations whose device events have been reached go on; True if
        any did."""
        gated, self._gated = self._gated, []
        opened = False
        for fut in gated:
            if fut._state != PENDING:
                continue
            device = fut.device
            if all(device.query(event) for event in fut.waits):  # type: ignore[union-attr]
                fut.waits = None
                opened = True
                self._dep_done(fut)
            else:
                self._gated.append(fut)
        self._run_work()
        return opened

    def _fail_on_stream(self, fut: CommFuture, error: BaseException) -> None:
        """``fut`` failed after its dependants on the device went on behind it on their
        streams (`_enqueued`): they read or overwrite what it did not produce, so they fail
        too (given up and their communicator broken, if issued)."""
        dependants, fut._on_stream = fut._on_stream, None
        for dep in dependants:  # type: ignore[union-attr]
            if dep._state >= DONE or (dep._state == ISSUED and dep not in dep.lane.track):
                continue  # it ended, or was given up already (its settle is queued)
            failure = DependencyFailedError(
                f"{dep.kind}#{dep.seq} on {dep.lane.backend_name} waited on its stream for "
                f"{fut.kind}#{fut.seq}, which {STATE_NAMES[fut._state].lower()}: {error}")
            if dep._state == ISSUED:
                # Issued, it reaches its peers with what fut did not produce: it must not
                # run as they expect, so it breaks its communicator (rule 7), as a dependant
                # still pending would by failing.
                self._give_up(dep, failure)
                if dep.lane.size > 1:
                    self._break(dep.lane.comm, f"on rank {dep.lane.rank}, {failure}", dep)
            else:
                self._work.append((dep, failure))

    if TYPE_CHECKING:  # the engine's other parts
        def _dep_done(self, dep: CommFuture) -> None: ...
        def _run_work(self) -> None: ...
        def _give_up(self, fut: CommFuture, error: BaseException) -> None: ...
        def _break(self, comm: CommState, cause: str, culprit: CommFuture | None = None
                   ) -> None: ...
