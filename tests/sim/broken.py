"""Deliberately broken policies, for showing that the harness catches what they break.

They live here, in the test suite, and nowhere in the library: each is one of the designs
docs/design.md rejects.
"""

from __future__ import annotations

from mcrdl.backends._staging import StagedBackend
from mcrdl.engine import Engine
from mcrdl.engine._states import DONE, PENDING
from mcrdl.front._select import Selector


class ReadyFirstEngine(Engine):
    """Issues whichever operation of a lane is ready first, instead of in submission order."""

    def _pump(self, lane):  # type: ignore[no-untyped-def]
        for fut in list(lane.pending):
            if fut._state != PENDING:
                lane.pending.remove(fut)
            elif fut._deps_left == 0:
                lane.pending.remove(fut)
                self._issue(fut, self._clock())

    def _release(self, fut, error):  # type: ignore[no-untyped-def]
        dependants = fut._dependants
        super()._release(fut, error)
        for dep in dependants or ():
            if dep._state == PENDING and dep._deps_left == 0:
                self._pump(dep.lane)

    def submit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        fut = super().submit(*args, **kwargs)
        if fut._state < DONE:
            with self._lock:
                self._pump(fut.lane)
                self._run_work()
        return fut


class PerRankSelector(Selector):
    """backend="auto" decided by each rank for itself (odd ranks prefer the other backend)."""

    def __init__(self, rank: int, backends: tuple[str, ...]) -> None:
        order = tuple(backends) if rank % 2 == 0 else tuple(reversed(backends))
        super().__init__(backends, preference=order)


class LaneGoesOnEngine(Engine):
    """Never breaks a communicator: when one rank's operation ends without being issued, its
    lane issues the next one as if nothing happened (what mcrdl did before docs/design.md's rule 7)."""

    def _break(self, comm, cause, culprit=None, issued=False):  # type: ignore[no-untyped-def]
        pass


class NamesIgnoredEngine(Engine):
    """Issues named operations in each rank's own submission order, as if they had no names
    (what plain position matching does with collectives from concurrent tasks)."""

    def submit(self, fut, after=(), route=None, named=None):  # type: ignore[no-untyped-def]
        return super().submit(fut, after, route)


class NoStreamWaitEngine(Engine):
    """Lets an operation on a device stream go on once the operation it depends on is queued
    on another stream, without making its stream wait for that one's end."""

    def _edge_event(self, fut, dep):  # type: ignore[no-untyped-def]
        pass


class NoCallerEventEngine(Engine):
    """Ignores the caller's current stream: an operation on device buffers may run before
    the work the caller queued before submitting it."""

    def _caller_event(self, fut):  # type: ignore[no-untyped-def]
        pass


class HostOnEnqueueEngine(Engine):
    """Treats every dependant of a device operation as a stream: a host lane's operation
    goes on once the device operation it depends on is queued, not once it has run."""

    def _enqueued(self, fut):  # type: ignore[no-untyped-def]
        for dep in fut._dependants:
            if dep._state == PENDING and dep._placement is None:
                if dep.lane.stream is not None:
                    self._edge_event(dep, fut)
                self._dep_done(dep)
        fut._dependants = None


class CopyInIgnoredBackend(StagedBackend):
    """Makes the host backend's call on the host copies without waiting for the copies from
    the device to have run."""

    def _may_start(self, staged):  # type: ignore[no-untyped-def]
        return True


class CopyBackIgnoredBackend(StagedBackend):
    """Reports an operation finished once its host call has, while its result is still being
    copied back to the device."""

    def _copied_back(self, staged):  # type: ignore[no-untyped-def]
        return True
