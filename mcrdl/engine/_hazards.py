"""Buffer hazards: which unfinished operations a new one must follow because they touch its bytes.

Program order across backends comes from here. Every unfinished operation registers the byte
ranges it reads and writes; a new operation depends on each overlapping one where at least one
side writes (read-after-write, write-after-read, write-after-write). Reads never order reads.

Ranges are kept per exact ``(start, stop)`` region with that region's last writer and the readers
since; a sorted list of region starts answers "which regions overlap [a, b)" in O(log n + k),
so that the cost per operation stays flat with thousands of operations in flight
(``benchmarks/overhead.py`` measures it). A linear scan over all in-flight operations was
rejected: 10,000 in flight made every submission 10,000 comparisons.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._future import CommFuture

__all__ = ["HazardIndex"]


class _Region:
    """The unfinished accesses to one exact byte range, in submission order.

    Invariants:
    - ``accesses`` maps every unfinished operation touching the range to whether it writes.
    - unless ``broken``, every access older than ``writer`` finishes before ``writer`` can
      (``writer`` depends on it), so ``writer`` and ``readers`` (the reads since) stand for all.
    - ``broken`` is set when an access ended abnormally (failed or cancelled) while older ones
      may still run; then conflicts come from the full ``accesses`` until the range is idle.
    """

    __slots__ = ("accesses", "writer", "readers", "broken")

    def __init__(self) -> None:
        self.accesses: dict[CommFuture, bool] = {}
        self.writer: CommFuture | None = None
        self.readers: dict[CommFuture, None] = {}  # ordered set
        self.broken = False


class HazardIndex:
    """Unfinished operations by the byte ranges they read and write.

    Invariants:
    - ``_regions[start][stop]`` exists iff some unfinished operation reads or writes exactly
      [start, stop); ``_starts`` is the sorted list of the keys of ``_regions``.
    - ``_maxlen`` is at least the length of every region present (it grows while any region
      exists and resets when none does; it bounds how far back an overlap query looks).
    """

    __slots__ = ("_regions", "_starts", "_maxlen")

    def __init__(self) -> None:
        self._regions: dict[int, dict[int, _Region]] = {}
        self._starts: list[int] = []
        self._maxlen = 0

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __len__(self) -> int:
        return sum(len(by_stop) for by_stop in self._regions.values())

    def _overlapping(self, start: int, stop: int) -> list[_Region]:
        starts = self._starts
        hi = bisect_left(starts, stop)
        lo = bisect_left(starts, start - self._maxlen + 1)
        found = []
        regions = self._regions
        for i in range(lo, hi):
            for rstop, region in regions[starts[i]].items():
                if rstop > start:
                    found.append(region)
        return found

    def conflicts(
        self, reads: tuple[tuple[int, int], ...], writes: tuple[tuple[int, int], ...]
    ) -> dict[CommFuture, None]:
        """The unfinished operations that an operation with these ranges must follow."""
        deps: dict[CommFuture, None] = {}
        for start, stop in writes:
            for region in self._overlapping(start, stop):
                if region.broken:
                    deps.update(dict.fromkeys(region.accesses))
                    continue
                if region.writer is not None:
                    deps[region.writer] = None
                deps.update(region.readers)
        for start, stop in reads:
            for region in self._overlapping(start, stop):
                if region.broken:
                    deps.update((f, None) for f, w in region.accesses.items() if w)
                elif region.writer is not None:
                    deps[region.writer] = None
        return deps

    def _region(self, start: int, stop: int) -> _Region:
        by_stop = self._regions.get(start)
        if by_stop is None:
            by_stop = self._regions[start] = {}
            insort(self._starts, start)
        region = by_stop.get(stop)
        if region is None:
            region = by_stop[stop] = _Region()
            if stop - start > self._maxlen:
                self._maxlen = stop - start
        return region

    def add(
        self,
        fut: CommFuture,
        reads: tuple[tuple[int, int], ...],
        writes: tuple[tuple[int, int], ...],
    ) -> None:
        """Record ``fut``'s accesses; it has been given its dependencies already."""
        for start, stop in writes:
            region = self._region(start, stop)
            region.accesses[fut] = True
            region.writer = fut
            region.readers = {}
        for start, stop in reads:
            region = self._region(start, stop)
            if fut not in region.accesses:
                region.accesses[fut] = False
                region.readers[fut] = None

    def remove(
        self,
        fut: CommFuture,
        reads: tuple[tuple[int, int], ...],
        writes: tuple[tuple[int, int], ...],
        *,
        normal: bool,
    ) -> None:
        """Forget ``fut``'s accesses; ``normal`` is False when it failed or was cancelled."""
        regions = self._regions
        for start, stop in (*writes, *reads):
            by_stop = regions.get(start)
            if by_stop is None:
                continue
            region = by_stop.get(stop)
            if region is None or region.accesses.pop(fut, None) is None:
                continue
            if region.accesses:
                if region.writer is fut:
                    region.writer = None
                region.readers.pop(fut, None)
                if not normal:
                    region.broken = True
                continue
            del by_stop[stop]
            if not by_stop:
                del regions[start]
                starts = self._starts
                del starts[bisect_left(starts, start)]
        if not self._starts:
            self._maxlen = 0
