"""Named operations: matched across a communicator's members by name, in an order they agree on.

Collectives submitted from concurrent asyncio tasks reach a communicator in an order that
timing decides, and timing differs between ranks (rule 8 of docs/design.md). A collective given
``name=`` is therefore not placed in a lane when it is submitted: it waits, in the hazard DAG
like any operation, until its dependencies have finished (it is *ready*), then until every
member has it ready too. The members agree on that in *rounds*: each round is one small
allgather, on the communicator's named lane of the runtime's control backend, of what each
member has ready. What every member has ready is placed, in one order computed alike from the
same table, at the end of the named lanes (one per backend, with groups of their own, so that
named operations never share positions with unnamed ones, which keep submission order).

Why rounds of allgathers, not a coordinator as Horovod has: a round is one collective with no
rank in the middle (one hop where a coordinator needs two: a request in, a response out), it
runs on the same engine as every other operation (no thread, no polling of a socket), and
every member learns what every other one has ready, which is what a timeout needs to name the
members that lack a name.

The response cache (Horovod's idea): a (name, signature) the members agreed on once gets a
*slot*, the same number on every member (slots are given in agreed order). Afterwards a round
carries a bit per slot, so a training step that submits the same names every iteration agrees
on all of them with one allgather of a few words, whatever their number. A name with no slot
yet is first *announced* (its length in bytes), then *published* in the next round's name
area, sized by the largest announcement; it is agreed once every member has published it.
The cache holds ``CACHE_SLOTS`` keys: once full, a newly agreed key takes the slot of the
least recently agreed one (every member evicts the same, since each reads the same tables in
the same order), and an operation ready here under the evicted key is offered by name again.
So a program that names its operations per step (``f"step{s}/grad{i}"``) keeps the rows
bounded; a step of more than ``CACHE_SLOTS`` names stays right but publishes names every
round. A finished operation is forgotten at the next round (its buffers with it).

When a member posts a round (one in flight at a time), so that every member that has
something left posts again, and none spins rounds that cannot agree anything:
- at the engine's next poll after an operation became ready here, if no round is in flight
  (a waiting task yields once to the event loop first, so that its sibling tasks submit
  theirs before that poll);
- at once after a round, if an operation became ready meanwhile, if a member announced
  names (everybody joins the round that publishes them), or if something is left here and
  the round agreed something or this member lacks nothing that another one has left;
- otherwise, with something left, after a back-off (``_BACKOFF_MIN`` doubling to
  ``_BACKOFF_MAX`` while rounds agree nothing), or at once when an operation becomes ready.
Two members each lacking what the other has left would otherwise run rounds that agree
nothing back to back, for as long as the skew between them lasts (a rank computing a
micro-batch the other has finished); waiting for their own arrivals alone is not enough: what
this member lacks may itself wait here for one of the names it has left (a dependency that
only the members of a sub-communicator have), so it posts again after the back-off.

What a round places goes to the engine in the agreed order, small host allreduces fused
(`mcrdl.engine._fusion`: one allreduce for many, Horovod's tensor fusion).

A signature (operation, dtype, shape, root, reduce op, backend, and whether the buffers are
in device memory) travels with each name: the same name with another signature on another
member fails with DesyncError on every member that holds it, naming both. A name that some
members never submit fails, after the runtime's timeout, with DesyncError naming the members
that did not have it at the last round. Both break the communicator (rule 7): the members no
longer agree on what runs next.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from functools import reduce
from operator import and_
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core._buffers import new_buffer
from ..core._errors import DesyncError
from ..core._types import DType
from ._fusion import fuse
from ._future import CommFuture
from ._states import AGREEMENT_KIND, DONE

if TYPE_CHECKING:
    from ._lanes import CommState, Lane
    from ._core import Engine

__all__ = ["MAX_NAME_BYTES", "Names"]

#: Bytes of names one round publishes at most (more wait for the next round).
_AREA_CAP = 1 << 16
#: int64 words of a round's row before the slot bits: the round's number, the bytes this
#: member has left to publish, the bytes of this round's name area.
_HEAD = 3
_HEAD_WORDS = struct.Struct("<3q")
#: The longest name (UTF-8 bytes).
MAX_NAME_BYTES = 1024
#: Keys the response cache holds (a round's row carries a bit per slot: 64 words at most).
CACHE_SLOTS = 4096
#: Seconds before re-posting after a round that agreed nothing, while nothing new is ready
#: here; doubled after each such round up to the maximum.
_BACKOFF_MIN = 50e-6
_BACKOFF_MAX = 2e-3
_EMPTY: tuple[tuple[int, int], ...] = ()


def _bits(mask: int) -> Iterator[int]:
    """The numbers of the bits set in ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1


def _mask(words: list[int]) -> int:
    """The slot bits of a row's mask words (as `Names._post` wrote them, read unsigned)."""
    mask = 0
    for i, word in enumerate(words):
        mask |= word << (64 * i)
    return mask


def _entry(key: tuple[str, str]) -> bytes:
    return key[0].encode() + b"\0" + key[1].encode() + b"\0"


class Names:
    """The named operations of one communicator, and the rounds that agree on them.

    The `Placement` of every named operation of its communicator. Everything here runs with
    the engine's lock held: ``hold`` from ``Engine.submit``, ``ready`` when an operation's
    dependencies have finished, ``drop`` when one fails before it was placed, the round's
    finishing step when a round completes.

    Invariants:
    - ``held`` maps each named operation submitted here and not yet placed to its
      [signature, the time it became ready (None while its dependencies run)].
    - ``live`` maps a name to the last operation submitted with it, until a round after
      that operation finished (or a submission that finds ``live`` past ``forget_at``).
    - ``keys[i]`` is the (name, signature) of slot ``i``; ``slots`` is its inverse; both
      are the same on every member, and hold at most ``CACHE_SLOTS`` keys. ``recent`` holds
      every slot, the least recently agreed first.
    - bit ``i`` of ``mask`` is set while ``by_slot[i]``, a ready operation of slot ``i``,
      waits here; ``fresh`` maps the keys of ready operations without a slot to them, in
      the order they became ready; ``unpublished`` holds those not yet published.
    - ``published[r]`` holds the keys member ``r`` published that are not agreed on yet
      (the same on every member: each learns them from the same tables).
    - ``current`` is the round in flight (one at a time), None when none is; ``later`` the
      time at which to post the next one (None: at the next arrival only).
    - ``spare``, when set, is the last round that ended: its row's bytes, its table and their
      buffers, which no backend uses any more; the next round of the same width reuses them.
    """

    #: Awaiting tasks give their loop one iteration first: their siblings' operations then
    #: go in the same round.
    gathers = True

    def __init__(self, engine: Engine, comm: CommState, lane: Lane,
                 fusion_bytes: int) -> None:
        self.engine = engine
        self.fusion_bytes = fusion_bytes  # (0: no fusion; the same on every member)
        self.comm = comm
        self.lane = lane
        self.rank = comm.rank
        self.size = comm.size
        self.held: dict[CommFuture, list[Any]] = {}
        self.live: dict[str, CommFuture] = {}
        self.forget_at = 64  # live's size at which a submission forgets the finished
        self.keys: list[tuple[str, str]] = []
        self.slots: dict[tuple[str, str], int] = {}
        self.recent: dict[int, None] = {}
        self.mask = 0
        self.by_slot: dict[int, CommFuture] = {}
        self.fresh: dict[tuple[str, str], CommFuture] = {}
        self.unpublished: dict[tuple[str, str], None] = {}
        self.published: list[dict[tuple[str, str], None]] = [{} for _ in range(self.size)]
        self.current: CommFuture | None = None
        self.rounds = 0
        self.area = 0  # bytes of the next round's name area
        self.spare: tuple[bytearray, np.ndarray, tuple[Any, Any]] | None = None
        self.changed = False  # an operation became ready during the round in flight
        self.later: float | None = None
        self.backoff = _BACKOFF_MIN
        # What the last completed round said, for timeouts: when, and each member's bits.
        self.last_time = -1.0
        self.last_masks: list[int] = []
        self.evicted: list[int] = []  # slots that changed keys after the last round's masks

    # -- operations ----------------------------------------------------------------------

    def hold(self, fut: CommFuture, sig: str) -> None:
        """Take the named ``fut`` (signature ``sig``) until its members agree on it.

        Raises:
            ValueError: an unfinished operation here has the same name.
        """
        name = fut.name
        prior = self.live.get(name)  # type: ignore[arg-type]
        if prior is not None and prior._state < DONE:
            raise ValueError(
                f"name {name!r} is in use on communicator {self.comm.name}: {prior!r} has "
                f"not finished; a name stands for one operation at a time: wait for it "
                f"first, or give this one another name"
            )
        live = self.live
        live[name] = fut  # type: ignore[index]
        self.held[fut] = [sig, None]
        if len(live) > self.forget_at:  # (no rounds in a world of one, or none for long)
            self._forget()

    def ready(self, fut: CommFuture) -> None:
        """``fut``'s dependencies have finished: offer it to the members' agreement."""
        entry = self.held[fut]
        entry[1] = self.engine.now()
        if self.size == 1:
            del self.held[fut]
            self.engine.place([fut])
            return
        key = (fut.name, entry[0])
        slot = self.slots.get(key)  # type: ignore[arg-type]
        if slot is not None:
            self.by_slot[slot] = fut
            self.mask |= 1 << slot
        else:
            self.fresh[key] = fut  # type: ignore[index]
            self.unpublished[key] = None  # type: ignore[index]
        if self.current is not None:
            self.changed = True
        elif self.later is None or self.later > entry[1]:
            # At the engine's next poll, not now: operations submitted in a burst (asyncio
            # tasks, each until its first await; a loop of submissions before a wait) then
            # go in one round instead of one round each.
            self.later = entry[1]
            self.engine.defer(self)

    def due(self, now: float) -> None:
        """Post the deferred round if its time has come (the engine's polls call this)."""
        if self.later is not None and now >= self.later:
            self._post()

    def drop(self, fut: CommFuture) -> None:
        """``fut`` failed before it was placed (its communicator breaks, or broke)."""
        entry = self.held.pop(fut, None)
        if entry is None:
            return
        key = (fut.name, entry[0])
        slot = self.slots.get(key)  # type: ignore[arg-type]
        if slot is not None and self.by_slot.get(slot) is fut:
            del self.by_slot[slot]
            self.mask &= ~(1 << slot)
        elif self.fresh.get(key) is fut:  # type: ignore[arg-type]
            del self.fresh[key]  # type: ignore[arg-type]
            self.unpublished.pop(key, None)  # type: ignore[arg-type]

    def fail(self, futs: list[tuple[CommFuture, DesyncError]]) -> None:
        """Fail each held future with its error, and break the communicator for the first
        (the members no longer agree on what runs next)."""
        self.engine.fail_and_break(futs, self.comm,  # type: ignore[arg-type]
                                   f"on rank {self.rank}, {futs[0][1]}")

    def position(self, fut: CommFuture, lane: Lane) -> int | None:
        """None: a named operation holds no position before its members agree on it."""
        return None

    def expired(self, limit: float) -> list[CommFuture]:
        """The ready operations that have waited for agreement since before ``limit``."""
        return [f for f, (_, t) in self.held.items() if t is not None and t < limit]

    # -- rounds --------------------------------------------------------------------------

    def _post(self) -> None:
        """Post the next round: what is ready here, as bits and published names."""
        if self.comm.broken is not None:
            return
        self.rounds += 1
        self.changed = False
        self.later = None
        words = max(1, (len(self.keys) + 63) // 64)
        area = self.area
        names = bytearray()
        left = 0
        for key in self.unpublished:
            blob = _entry(key)
            if len(names) + len(blob) <= area:
                names += blob
            else:
                left += len(blob)
        # The row is written in place: a steady state posts rows of one width every round,
        # and the previous round's row, table and buffers (`spare`) are free once it ended.
        width = (_HEAD + words) * 8 + area
        spare = self.spare
        if spare is not None and len(spare[0]) == width:
            data, table, bufs = spare
            self.spare = None
        else:
            data = bytearray(width)
            row = np.frombuffer(data, dtype=np.int64).reshape(1, -1)
            table = np.empty((self.size, row.shape[1]), dtype=np.int64)
            bufs = (new_buffer(row, False, DType.INT64), new_buffer(table, False, DType.INT64))
        _HEAD_WORDS.pack_into(data, 0, self.rounds, left, area)
        at = _HEAD * 8
        data[at:at + words * 8] = self.mask.to_bytes(words * 8, "little")
        if area:
            data[at + words * 8:] = names + bytes(area - len(names))
        lane = self.lane
        fut = CommFuture(
            AGREEMENT_KIND, lane, self.rounds, lane.backend.start_allgather, (lane.group, *bufs),
            _EMPTY, _EMPTY, table, width, self._agreed, (data, table, bufs))
        self.current = fut
        self.engine.add_own(fut)

    def _agreed(self, fut: CommFuture) -> None:
        """A round finished (its finishing step): place what every member has ready."""
        self.current = None
        if self.comm.broken is not None:
            return
        table: np.ndarray = fut._result
        size, me = self.size, self.rank
        words = max(1, (len(self.keys) + 63) // 64)
        # (one call, unsigned: Python ints from here on, each mask word as it was written)
        rows = table.view(np.uint64)[:, :_HEAD + words].tolist()
        if words == 1:  # (up to 64 slots)
            masks = [row[_HEAD] for row in rows]
        else:
            masks = [_mask(row[_HEAD:]) for row in rows]
        everywhere = reduce(and_, masks)
        published = self.published
        area = rows[0][2]
        if area:
            for r in range(size):
                for key in self._parse(table[r], words, area):
                    published[r][key] = None
                    if r == me:
                        del self.unpublished[key]
        recent = self.recent
        placed = []
        for slot in _bits(everywhere):
            placed.append(self.by_slot.pop(slot))
            del recent[slot]  # now the most recently agreed
            recent[slot] = None
        self.mask &= ~everywhere
        agreed = []
        if any(published):
            agreed = [k for k in published[0] if all(k in p for p in published[1:])]
            for key in agreed:
                for p in published:
                    del p[key]
                placed.append(self.fresh.pop(key))
        for f in placed:
            del self.held[f]
        if len(placed) > 1 and self.fusion_bytes:
            fuse(placed, self.fusion_bytes)
        engine = self.engine
        engine.place(placed)
        self.last_time = now = engine.now()
        self.last_masks = masks
        lacking = self._check_signatures(masks, everywhere)  # (with the slots as posted)
        self.evicted = [self._cache(key) for key in agreed]
        self._forget()
        self.area = min(_AREA_CAP, (max([row[1] for row in rows]) + 7) // 8 * 8)
        self.spare = fut.hold  # (the backend is done with them: the next row's)
        left = self.mask or self.fresh
        if placed:
            self.backoff = _BACKOFF_MIN
        if self.area or self.changed or (left and (placed or not lacking)):
            self._post()
        elif left:
            self.later = now + self.backoff
            self.backoff = min(2 * self.backoff, _BACKOFF_MAX)
            engine.defer(self)

    def _forget(self) -> None:
        """Drop the finished operations from ``live`` (their results with them)."""
        live = self.live
        for name in [n for n, f in live.items() if f._state >= DONE]:
            del live[name]
        self.forget_at = 2 * len(live) + 64  # amortized: O(1) per submission

    def _cache(self, key: tuple[str, str]) -> int:
        """Give the agreed ``key`` a slot: a new one while there is room, else the least
        recently agreed one's; return the slot taken from another key (-1: none)."""
        keys, recent = self.keys, self.recent
        if len(keys) < CACHE_SLOTS:
            slot = self.slots[key] = len(keys)
            keys.append(key)
            recent[slot] = None
            return -1
        slot = next(iter(recent))
        del recent[slot]
        recent[slot] = None
        old = keys[slot]
        del self.slots[old]
        keys[slot] = key
        self.slots[key] = slot
        fut = self.by_slot.pop(slot, None)
        if fut is not None:  # ready here under the old key: offered by name from now on
            self.mask &= ~(1 << slot)
            self.fresh[old] = fut
            self.unpublished[old] = None
        return slot

    def _parse(self, row: np.ndarray, words: int, area: int) -> list[tuple[str, str]]:
        start = (_HEAD + words) * 8
        parts = row.view(np.uint8)[start:start + area].tobytes().split(b"\0")
        out = []
        for i in range(0, len(parts) - 1, 2):
            if not parts[i]:
                break
            out.append((parts[i].decode(), parts[i + 1].decode()))
        return out

    def _check_signatures(self, masks: list[int], everywhere: int) -> bool:
        """Fail what another member holds under the same name with another signature;
        return whether this member lacks something another one has left."""
        me = self.rank
        theirs = 0
        for r, m in enumerate(masks):
            if r != me:
                theirs |= m
        theirs &= ~everywhere
        if not theirs and not any(self.published):  # (the steady state: nothing to check)
            return False
        others = [k for r, p in enumerate(self.published) if r != me for k in p]
        lacking = bool(theirs & ~self.mask)
        others.extend(self.keys[slot] for slot in _bits(theirs))
        for key in others:
            name, sig = key
            mine = self.live.get(name)
            if mine is None or mine not in self.held:
                lacking = True
                continue
            my_sig = self.held[mine][0]
            if my_sig != sig:
                self.fail([(mine, DesyncError(
                    f"named operation {name!r} on communicator {self.comm.name}: this rank "
                    f"submitted it as {my_sig}, another member as {sig}; a name must stand "
                    f"for the same operation on every member"))])
            elif self.held[mine][1] is None:
                lacking = True
        return lacking

    # -- diagnosis -----------------------------------------------------------------------

    def why(self, fut: CommFuture, timeout: float) -> str:
        """Why ``fut`` was not agreed on within ``timeout``: who lacks it."""
        sig, ready = self.held[fut]  # (ready: only ready operations expire)
        key = (fut.name, sig)
        me = self.rank
        others = [r for r in range(self.size) if r != me]
        head = (f"named {fut.kind} {fut.name!r} ({sig}) on communicator {self.comm.name} was "
                f"not agreed on within {timeout:g} s of being ready on rank {me}")
        if ready is None or self.last_time < ready:
            who = (f"rank {others[0]} has" if len(others) == 1 else
                   f"one or more of ranks {', '.join(map(str, others))} have")
            return (f"{head}: {who} not submitted it (no agreement round has completed "
                    f"since; every member must submit each name)")
        slot = self.slots.get(key)  # type: ignore[arg-type]
        if slot in self.evicted:
            slot = None  # the last masks' bit there meant the key it had before
        missing = [r for r in others
                   if not ((slot is not None and self.last_masks[r] >> slot & 1)
                           or key in self.published[r])]
        age = self.engine.now() - self.last_time
        if not missing:
            return (f"{head}: every member had it at the last agreement round, {age:.3g} s "
                    f"ago, but the next round did not complete")
        ranks = ", ".join(map(str, missing))
        return (f"{head}: rank{'s' if len(missing) > 1 else ''} {ranks} had not submitted it "
                f"(or its dependencies there had not finished) at the last agreement round, "
                f"{age:.3g} s ago; every member must submit each name")

    def waiting(self, now: float) -> list[str]:
        """Flight-recorder lines: the named operations waiting here, and for what."""
        if not self.held:
            return []
        lines = [f"  named operations of {self.comm.name} rank {self.rank}/{self.size} "
                 f"(round {self.rounds}{' in flight' if self.current is not None else ''})"]
        for fut, (sig, ready) in self.held.items():
            state = ("waiting for its dependencies" if ready is None
                     else f"ready {now - ready:9.6f}s ago, waiting for agreement")
            lines.append(f"    {fut.kind}#{fut.seq} {fut.name!r} {sig}: {state}")
        return lines
