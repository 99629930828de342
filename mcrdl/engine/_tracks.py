"""Tracks: one backend's issued, unfinished requests, tested a bounded window at a time.

Testing every in-flight request on every poll made the engine's cost per operation grow with
the number in flight (``Testsome`` over all of them, and rebuilding the list after each
completion, are O(n) each). A track instead tests the oldest ``WINDOW`` requests
(collectives finish roughly in issue order) plus a window that rotates over the rest, so
every request is tested within ``len / WINDOW`` polls (rule 5 of docs/design.md: progress
everywhere). Finished entries leave holes that are compacted once they make up most of the
list, so removal is amortized O(1): the holes before the oldest live entry and after the
newest are dropped at once, and the others are squeezed out once there are more of them than
live entries and a window. (Behind one long-lived request, a receive posted for a stop
message, the holes of every later operation would otherwise pile up, and a new request would
wait len/64 polls for the rotating window to reach it.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._states import ISSUED

if TYPE_CHECKING:
    from ..backends import Backend
    from ._future import CommFuture

__all__ = ["Track", "WINDOW", "with_carried"]

#: Requests tested per window (the oldest window and the rotating one).
WINDOW = 64


class Track:
    """The issued, unfinished requests of one backend, in issue order.

    Invariants:
    - ``futs[i]`` is None exactly where ``reqs[i]`` finished (a hole); ``first`` is the
      index of the oldest entry that is not a hole (or ``len(futs)``).
    - ``live`` counts the entries that are not holes.
    """

    __slots__ = ("backend", "futs", "reqs", "first", "live", "rot", "self_progressing")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.futs: list[CommFuture | None] = []
        self.reqs: list[Any] = []
        self.first = 0
        self.live = 0
        self.rot = 0
        self.self_progressing: bool = backend.capabilities.self_progressing

    def add(self, fut: CommFuture, req: Any) -> None:
        """Record an issued request."""
        self.futs.append(fut)
        self.reqs.append(req)
        self.live += 1

    def poll(self) -> list[tuple[CommFuture, BaseException | None]]:
        """Test a window of requests; return (and forget) the finished ones."""
        futs = self.futs
        first = self.first
        end = len(futs)
        if end - first == self.live and self.live <= WINDOW:
            # No holes, few requests: test them all, in one call.
            done = self.backend.test(self.reqs if first == 0 else self.reqs[first:])
            if not done:
                return []
            finished = [(futs[first + i], err) for i, err in done]
            if len(done) == self.live:
                self.empty()
                return finished  # type: ignore[return-value]
            for i, _ in done:
                self._hole(first + i)
            self._compact()
            return finished  # type: ignore[return-value]
        idx = [i for i in range(first, min(end, first + WINDOW)) if futs[i] is not None]
        if end - first > WINDOW:
            lo = self.rot if first + WINDOW <= self.rot < end else first + WINDOW
            hi = min(end, lo + WINDOW)
            idx.extend(i for i in range(lo, hi) if futs[i] is not None)
            self.rot = hi if hi < end else first + WINDOW
        reqs = self.reqs
        done = self.backend.test([reqs[i] for i in idx])
        if not done:
            return []
        finished = []
        for j, err in done:
            i = idx[j]
            finished.append((futs[i], err))
            self._hole(i)
        self._compact()
        return finished  # type: ignore[return-value]

    def _hole(self, i: int) -> None:
        self.futs[i] = None
        self.reqs[i] = None
        self.live -= 1

    def _compact(self) -> None:
        futs = self.futs
        while futs and futs[-1] is None:  # the newest finished first (behind an old one)
            futs.pop()
            self.reqs.pop()
        end = len(futs)
        first = min(self.first, end)
        while first < end and futs[first] is None:
            first += 1
        if first == end:
            self.empty()
            return
        if first > WINDOW and first * 2 > end:
            del futs[:first]
            del self.reqs[:first]
            self.rot = max(0, self.rot - first)
            end -= first
            first = 0
        if end - first - self.live > max(WINDOW, self.live):  # holes among the live ones
            reqs = self.reqs
            keep = [i for i in range(first, end) if futs[i] is not None]
            self.futs = [futs[i] for i in keep]
            self.reqs = [reqs[i] for i in keep]
            self.rot = 0  # (wraps to the first rotating position at the next poll)
            first = 0
        self.first = first

    def __contains__(self, fut: CommFuture) -> bool:
        """Whether ``fut`` is live here (O(n): for failure paths only)."""
        return fut in self.futs[self.first:]

    def remove(self, fut: CommFuture) -> Any:
        """Forget ``fut`` (cancelled or timed out); returns its request."""
        i = self.futs.index(fut, self.first)
        req = self.reqs[i]
        self._hole(i)
        self._compact()
        return req

    def items(self) -> list[tuple[CommFuture, Any]]:
        """The live (future, request) pairs, oldest first."""
        return [(f, r) for f, r in zip(self.futs[self.first:], self.reqs[self.first:])
                if f is not None]

    def clear(self) -> list[CommFuture]:
        """Forget everything; returns the futures that were live."""
        live = [f for f in self.futs[self.first:] if f is not None]
        self.empty()
        return live

    def empty(self) -> None:
        """Forget every entry (the caller has settled or taken the live ones)."""
        self.futs = []
        self.reqs = []
        self.first = self.live = self.rot = 0


def with_carried(futs: list[CommFuture]) -> list[CommFuture]:
    """``futs`` (issued), and the operations fused into them and in flight with them
    (`_fusion`: they have no request of their own)."""
    return futs + [m for f in futs if f.carried is not None for m in f.carried
                   if m._state == ISSUED]
