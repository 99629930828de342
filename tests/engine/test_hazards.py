"""The hazard index (``engine._hazards``), on its own: which unfinished accesses a new one must
follow."""

from __future__ import annotations

from tests.engine.support import A_HALF, A, B


class Op:
    """Stands for an operation: what the index reads of one."""

    def __init__(self, name, reads=(), writes=()):
        self.name, self.reads, self.writes = name, tuple(reads), tuple(writes)

    def __repr__(self):
        return self.name


def conflicts(index, reads=(), writes=()):
    """The names of the operations one with these ranges must follow (it is submitted, then
    ends at once)."""
    probe = Op("probe", reads, writes)
    found = [op.name for op in index.conflicts(probe) or ()]
    index.remove(probe, True)
    return found


def test_the_newest_operation_is_recorded_only_once_another_asks():
    """An operation issued at once is recorded when the next one asks for its conflicts, if
    it is unfinished then; one that ended before is never recorded; one queued is recorded
    at once (``add``); a zombie's ranges stay (``keep``)."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    first = Op("first", (), (A,))
    assert index.conflicts(first) is None and not index._regions  # issued at once
    index.remove(first, True)  # it ended: never recorded
    second = Op("second", (), (A,))
    assert index.conflicts(second) is None and not index._regions
    assert conflicts(index, (A,)) == ["second"]  # recorded once the probe asked
    queued = Op("queued", (B,), ())
    assert not index.conflicts(queued)
    index.add(queued)  # queued behind something: recorded now
    assert conflicts(index, (), (B,)) == ["queued"]
    zombie = Op("zombie", (), (A_HALF,))
    index.conflicts(zombie)
    index.keep(zombie)  # given up while its backend may still write A_HALF
    assert conflicts(index, (A_HALF,)) == ["second", "zombie"]


def test_hazard_index_forgets_only_the_accesses_it_holds():
    """Removing an operation from a range it never touched leaves that range's accesses
    alone, whether the range holds one access or several."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    w, r = Op("w", (), (A,)), Op("r", (A,), ())
    index.add(w)
    index.remove(Op("stranger", (), (A,)), True)
    assert conflicts(index, (A,), ()) == ["w"]
    index.add(r)
    index.remove(Op("stranger", (A,), (A,)), False)
    assert conflicts(index, (), (A,)) == ["w", "r"]
    index.remove(w, True)
    index.remove(r, True)
    assert not conflicts(index, (A,), (A,)) and not index._regions

def test_hazard_index_keeps_a_lone_access_without_a_region():
    """Most ranges in flight have one access: the index keeps that access itself, with no
    object for the garbage collector, and makes a region once a second access, or a second
    range at the same start, arrives; the answers stay the same."""
    from mcrdl.engine._hazards import HazardIndex, _Region

    index = HazardIndex()
    w, r, w2 = Op("w", (), (A,)), Op("r", (B,), ()), Op("w2", (), (A,))
    index.add(w)
    index.add(r)
    assert index._regions == {A[0]: w, B[0]: r}
    assert conflicts(index, (A_HALF,), ()) == ["w"]  # read after write
    assert conflicts(index, (B,), ()) == []  # reads never order reads
    assert conflicts(index, (), (B,)) == ["r"]  # write after read
    index.add(w2)  # a second access to A
    assert isinstance(index._regions[A[0]], _Region) and index._regions[B[0]] is r
    assert conflicts(index, (A,), ()) == ["w2"]  # w2 follows w
    view = (B[0], B[0] + 8)
    v = Op("v", (), (view,))
    index.add(v)  # a second range at B's start
    assert isinstance(index._regions[B[0]], _Region)
    assert conflicts(index, (), (B,)) == ["r", "v"]
    assert conflicts(index, (view,), ()) == ["v"]
    for op in (w, r, w2, v):
        index.remove(op, True)
    assert not index._regions and not index._lone

def test_an_operation_that_reads_and_writes_a_range_counts_as_writing_it():
    """Its read does not overwrite its write, alone on the range or among others, even once
    the range is broken and conflicts come from every access's own mode."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    index.add(Op("rw", (B,), (B,)))  # alone on B
    assert conflicts(index, (B,), ()) == ["rw"]
    w = Op("w", (), (A,))
    index.add(w)
    index.add(Op("rw2", (A,), (A,)))  # A's second access
    index.remove(w, False)  # ended abnormally: A is broken
    assert conflicts(index, (A,), ()) == ["rw2"]

def test_hazard_index_orders_every_overlap_through_churn():
    """Random adds and in-order-of-readiness removals over a small address pool, long enough
    that dead starts are reused and compacted: every overlapping unfinished access with a
    write on either side is a dependency, directly or through the dependencies it records.
    Some operations fail or are cancelled at any time, taking their dependants with them, as
    the engine fails them: what they leave behind is still ordered."""
    import random

    from mcrdl.engine._hazards import HazardIndex

    rng = random.Random(7)
    index = HazardIndex()
    live: dict[Op, tuple[tuple, tuple, set[Op]]] = {}  # op -> (reads, writes, deps)

    def ranges() -> tuple[tuple[int, int], ...]:
        out = []
        for _ in range(rng.choice((0, 1, 1, 2))):
            start = rng.randrange(0, 4000, 8)
            out.append((start, start + rng.choice((8, 16, 64, 256))))
        return tuple(out)

    def overlap(a, b) -> bool:
        return any(s < e2 and s2 < e for s, e in a for s2, e2 in b)

    def fail(first: int) -> None:  # first ends abnormally; its dependants fail with it
        doomed, todo = [first], [first]
        while todo:
            gone = todo.pop()
            for o, (_, _, deps) in live.items():
                if gone in deps and o not in doomed:
                    doomed.append(o)
                    todo.append(o)
        for o in doomed:
            live.pop(o)
            index.remove(o, False)

    for op in range(6000):
        if live and rng.random() < 0.03:
            fail(rng.choice(list(live)))
            continue
        if live and (len(live) > 300 or rng.random() < 0.45):
            ready = [o for o, (_, _, deps) in live.items() if not deps & live.keys()]
            done = rng.choice(ready)
            live.pop(done)
            index.remove(done, True)
            continue
        reads, writes = ranges(), ranges()
        new = Op(str(op), reads, writes)
        found = set(index.conflicts(new) or ())
        must = {o for o, (r, w, _) in live.items()
                if overlap(writes, r) or overlap(writes, w) or overlap(reads, w)}
        assert found <= must
        reach, todo = set(found), list(found)
        while todo:
            for dep in live[todo.pop()][2]:
                if dep in live and dep not in reach:
                    reach.add(dep)
                    todo.append(dep)
        assert must <= reach, (op, must - reach)
        live[new] = (reads, writes, found)
        index.add(new)
    assert len(index._starts) >= len(index._regions)
