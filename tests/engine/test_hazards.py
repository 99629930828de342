"""The hazard index (``engine._hazards``), on its own: which unfinished accesses a new one must
follow."""

from __future__ import annotations

from tests.engine.support import A_HALF, A, B


def test_hazard_index_forgets_only_the_accesses_it_holds():
    """Removing an operation from a range it never touched leaves that range's accesses
    alone, whether the range holds one access or several."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    index.add("w", (), (A,))
    index.remove("stranger", (), (A,), True)
    assert list(index.conflicts((A,), ())) == ["w"]
    index.add("r", (A,), ())
    index.remove("stranger", (A,), (A,), False)
    assert list(index.conflicts((), (A,))) == ["w", "r"]
    index.remove("w", (), (A,), True)
    index.remove("r", (A,), (), True)
    assert not index.conflicts((A,), (A,)) and not index._regions

def test_hazard_index_keeps_a_lone_access_without_a_region():
    """Most ranges in flight have one access: the index keeps that access itself, with no
    object for the garbage collector, and makes a region once a second access, or a second
    range at the same start, arrives; the answers stay the same."""
    from mcrdl.engine._hazards import HazardIndex, _Region

    index = HazardIndex()
    index.add("w", (), (A,))
    index.add("r", (B,), ())
    assert index._regions == {A[0]: "w", B[0]: "r"}
    assert list(index.conflicts((A_HALF,), ())) == ["w"]  # read after write
    assert list(index.conflicts((B,), ())) == []  # reads never order reads
    assert list(index.conflicts((), (B,))) == ["r"]  # write after read
    index.add("w2", (), (A,))  # a second access to A
    assert isinstance(index._regions[A[0]], _Region) and index._regions[B[0]] == "r"
    assert list(index.conflicts((A,), ())) == ["w2"]  # w2 follows w
    view = (B[0], B[0] + 8)
    index.add("v", (), (view,))  # a second range at B's start
    assert isinstance(index._regions[B[0]], _Region)
    assert list(index.conflicts((), (B,))) == ["r", "v"]
    assert list(index.conflicts((view,), ())) == ["v"]
    for op, reads, writes in (("w", (), (A,)), ("r", (B,), ()), ("w2", (), (A,)),
                              ("v", (), (view,))):
        index.remove(op, reads, writes, True)
    assert not index._regions and not index._lone

def test_an_operation_that_reads_and_writes_a_range_counts_as_writing_it():
    """Its read does not overwrite its write, alone on the range or among others, even once
    the range is broken and conflicts come from every access's own mode."""
    from mcrdl.engine._hazards import HazardIndex

    index = HazardIndex()
    index.add("rw", (B,), (B,))  # alone on B
    assert list(index.conflicts((B,), ())) == ["rw"]
    index.add("w", (), (A,))
    index.add("rw2", (A,), (A,))  # A's second access
    index.remove("w", (), (A,), False)  # ended abnormally: A is broken
    assert list(index.conflicts((A,), ())) == ["rw2"]

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
    live: dict[int, tuple[tuple, tuple, set[int]]] = {}  # op -> (reads, writes, deps)

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
            reads, writes, _ = live.pop(o)
            index.remove(o, reads, writes, False)

    for op in range(6000):
        if live and rng.random() < 0.03:
            fail(rng.choice(list(live)))
            continue
        if live and (len(live) > 300 or rng.random() < 0.45):
            ready = [o for o, (_, _, deps) in live.items() if not deps & live.keys()]
            done = rng.choice(ready)
            reads, writes, _ = live.pop(done)
            index.remove(done, reads, writes, True)
            continue
        reads, writes = ranges(), ranges()
        found = set(index.conflicts(reads, writes))
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
        live[op] = (reads, writes, found)
        index.add(op, reads, writes)
    assert len(index._starts) >= len(index._regions)
