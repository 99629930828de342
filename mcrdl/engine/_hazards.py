"""Buffer hazards: which unfinished operations a new one must follow because they touch its bytes.

Program order across backends comes from here. Every unfinished operation registers the byte
ranges it reads and writes; a new operation depends on each overlapping one where at least one
side writes (read-after-write, write-after-read, write-after-write). Reads never order reads.

Ranges are kept per exact ``(start, stop)`` region with that region's last writer and the readers
since; a sorted list of region starts answers "which regions overlap [a, b)" in O(log n + k),
so that the cost per operation stays flat with thousands of operations in flight
(``benchmarks/overhead.py`` measures it). A linear scan over all in-flight operations was
rejected: with thousands in flight, every submission made thousands of comparisons. Starts
leave the sorted list lazily, in batches: deleting each one at once moved the whole list
(operations finish oldest first, and the oldest sit at its front), an O(n) move per
operation.

A range with one access and no other range at its start (most ranges in flight: each
operation on its own buffer) is kept as that access itself, with its stop and mode in a
plain dict of ints: no object per range for the garbage collector to scan. It becomes a
``_Region`` when a second access or a second range at the same start arrives.

The newest operation is recorded only when the next one asks for its conflicts, if the
engine issued it at once (``add`` records one it queued): a program that waits for each
operation before submitting the next never pays for the index.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._future import CommFuture

__all__ = ["HazardIndex"]


class _Region:
    """The unfinished accesses to one exact byte range [start, stop), in submission order.

    Invariants:
    - ``accesses`` maps every unfinished operation touching the range to whether it writes
      (a range with one access and no other range at its start is not a region at all: see
      ``HazardIndex``).
    - unless ``broken``, every access older than ``writer`` finishes before ``writer`` can
      (``writer`` depends on it), so ``writer`` and ``readers`` (the reads since; None for
      none) stand for all of them.
    - ``broken`` is set when an access ended abnormally (failed or cancelled) while older ones
      may still run; then conflicts come from the full ``accesses`` until the range is idle.
    - ``other`` chains the regions that share this one's start (rare: a view and its base).
    """

    __slots__ = ("stop", "accesses", "writer", "readers", "broken", "other")

    def __init__(self, stop: int) -> None:
        self.stop = stop
        self.accesses: dict[CommFuture, bool] = {}
        self.writer: CommFuture | None = None
        self.readers: dict[CommFuture, None] | None = None
        self.broken = False
        self.other: _Region | None = None

    def note(self, fut: CommFuture, writes: bool) -> bool:
        """Record that ``fut`` accesses the range; False if it did already."""
        accesses = self.accesses
        if fut in accesses:
            return False
        accesses[fut] = writes
        return True


class HazardIndex:
    """Unfinished operations by the byte ranges they read and write.

    Invariants:
    - ``_regions[start]`` is either a lone access, the one unfinished access to the only range
      at ``start`` (then ``_lone[start]`` is that range's stop for a write, minus its stop for
      a read), or heads the chain of regions starting at ``start``, each holding at least one
      unfinished access (then ``start`` is not in ``_lone``).
    - ``_starts`` is a sorted list without repeats of the keys of ``_regions`` and of the
      starts in ``_dead`` (keys that left ``_regions`` and wait for the next compaction).
    - ``_maxlen`` is at least the length of every range present (it grows while any range
      exists and resets when none does; it bounds how far back an overlap query looks).
    - ``_newest`` is None, or the newest operation, unfinished and with ranges that are not
      recorded yet; the index holds every other unfinished operation's.
    """

    __slots__ = ("_regions", "_lone", "_starts", "_dead", "_maxlen", "_newest")

    def __init__(self) -> None:
        self._regions: dict[int, _Region | CommFuture] = {}
        self._lone: dict[int, int] = {}
        self._starts: list[int] = []
        self._dead: set[int] = set()
        self._maxlen = 0
        self._newest: CommFuture | None = None

    def _overlapping(self, start: int, stop: int, deps: dict[CommFuture, None],
                     writes: bool) -> list[_Region]:
        """The regions overlapping [start, stop); the lone accesses there that an access
        (a write if ``writes``) must follow go straight into ``deps``."""
        starts = self._starts
        hi = bisect_left(starts, stop)
        lo = bisect_left(starts, start - self._maxlen + 1)
        found = []
        regions = self._regions
        for i in range(lo, hi):
            at = starts[i]
            entry = regions.get(at)  # None: a dead start
            if isinstance(entry, _Region):
                region: _Region | None = entry
                while region is not None:
                    if region.stop > start:
                        found.append(region)
                    region = region.other
            elif entry is not None:  # a lone access
                end = self._lone[at]
                if end > start if end > 0 else (writes and -end > start):
                    deps[entry] = None
        return found

    def conflicts(self, fut: CommFuture) -> dict[CommFuture, None] | None:
        """The unfinished operations that ``fut``, the newest operation, must follow (None
        for none). Its own ranges are recorded when the next operation asks, if it is still
        unfinished then, or by ``add``."""
        newest = self._newest
        self._newest = fut if fut.reads or fut.writes else None
        if newest is not None:  # it is still unfinished: its ranges matter now
            self._record(newest)
        if not self._regions:
            return None
        reads, writes = fut.reads, fut.writes
        deps: dict[CommFuture, None] = {}
        for start, stop in writes:
            for region in self._overlapping(start, stop, deps, True):
                if region.broken:
                    deps.update(dict.fromkeys(region.accesses))
                    continue
                if region.writer is not None:
                    deps[region.writer] = None
                if region.readers:
                    deps.update(region.readers)
        for start, stop in reads:
            for region in self._overlapping(start, stop, deps, False):
                if region.broken:
                    deps.update((f, None) for f, w in region.accesses.items() if w)
                elif region.writer is not None:
                    deps[region.writer] = None
        return deps

    def _region(self, start: int, stop: int, fut: CommFuture, writes: bool) -> _Region | None:
        """The region of [start, stop), made if need be; None where ``fut`` is (or now
        becomes) the lone access there, which needs no more recording."""
        regions = self._regions
        head = regions.get(start)
        if head is None:  # a new range, and its lone access
            regions[start] = fut
            self._lone[start] = stop if writes else -stop
            dead = self._dead
            if start in dead:
                dead.discard(start)  # still in _starts
            else:
                insort(self._starts, start)
            if stop - start > self._maxlen:
                self._maxlen = stop - start
            return None
        if not isinstance(head, _Region):  # a lone access: fut's own, or a region from now on
            end = self._lone[start]
            if head is fut and (end if end > 0 else -end) == stop:
                return None  # recorded already (add records writes first: a write wins)
            del self._lone[start]
            lone = head
            head = regions[start] = _Region(end if end > 0 else -end)
            head.accesses[lone] = end > 0
            if end > 0:
                head.writer = lone
            else:
                head.readers = {lone: None}
        region: _Region | None = head
        while region is not None and region.stop != stop:
            region = region.other
        if region is None:
            region = _Region(stop)
            region.other = head.other
            head.other = region
            if stop - start > self._maxlen:
                self._maxlen = stop - start
        return region

    def add(self, fut: CommFuture) -> None:
        """Record ``fut``'s accesses now (it waits to be issued); it has been given its
        dependencies already."""
        if fut is self._newest:
            self._newest = None
        self._record(fut)

    def _record(self, fut: CommFuture) -> None:
        for start, stop in fut.writes:
            region = self._region(start, stop, fut, True)
            if region is not None:
                region.note(fut, True)
                region.writer = fut
                region.readers = None
        for start, stop in fut.reads:
            region = self._region(start, stop, fut, False)
            if region is not None and region.note(fut, False):
                if region.readers is None:
                    region.readers = {fut: None}
                else:
                    region.readers[fut] = None

    def keep(self, fut: CommFuture) -> None:
        """``fut`` ended, but its backend may still use its bytes (a zombie): its ranges stay
        recorded until ``remove``."""
        if fut is self._newest:
            self._newest = None
            self._record(fut)

    def remove(self, fut: CommFuture, normal: bool) -> None:
        """Forget ``fut``'s accesses; ``normal`` is False when it failed or was cancelled."""
        if fut is self._newest:
            self._newest = None
            return
        for start, stop in fut.writes:
            self._forget(fut, start, stop, normal)
        for start, stop in fut.reads:
            self._forget(fut, start, stop, normal)
        if not self._regions:
            self._maxlen = 0
            if self._starts:
                self._starts = []
                self._dead.clear()

    def _forget(self, fut: CommFuture, start: int, stop: int, normal: bool) -> None:
        head = self._regions.get(start)
        if head is None:
            return
        if not isinstance(head, _Region):  # a lone access: fut's, or not
            end = self._lone[start]
            if head is fut and (end if end > 0 else -end) == stop:
                del self._lone[start]
                self._drop_start(start)
            return
        prev = None
        region: _Region | None = head
        while region is not None and region.stop != stop:
            prev, region = region, region.other
        if region is None:
            return
        accesses = region.accesses
        if accesses.pop(fut, None) is None:
            return
        if accesses:
            if region.writer is fut:
                region.writer = None
            if region.readers:
                region.readers.pop(fut, None)
            if not normal:
                region.broken = True
            return
        if prev is not None:
            prev.other = region.other
        elif region.other is not None:
            self._regions[start] = region.other
        else:
            self._drop_start(start)

    def _drop_start(self, start: int) -> None:
        """``start`` holds nothing any more: it leaves ``_regions`` now, ``_starts`` later."""
        del self._regions[start]
        dead = self._dead
        dead.add(start)
        if len(dead) > 64 and len(dead) * 2 > len(self._starts):
            self._starts = [s for s in self._starts if s not in dead]
            dead.clear()
