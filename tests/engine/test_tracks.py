"""Tracks (``engine._tracks``): every in-flight request is tested within a bounded number of
polls, however many are in flight and in whatever order they finish."""

from __future__ import annotations

from tests.engine.support import submit


def test_many_in_flight_finishing_out_of_order_are_all_found(engine, mpi):
    """Tracks test a window of requests; those beyond it are found by the rotating window."""
    import random

    futs = [submit(engine, mpi, "allreduce", writes=[(0x10000 + 16 * i, 0x10000 + 16 * i + 8)])
            for i in range(300)]
    order = list(range(300))
    random.Random(7).shuffle(order)
    # finish only requests far from the oldest ones first: only the rotating window sees them
    for i in order[:150]:
        if i >= 64:
            mpi.finish(mpi.started[i])
    polls = 0
    while sum(f.done() for f in futs) < sum(1 for i in order[:150] if i >= 64):
        engine.poll()
        polls += 1
        assert polls < 50, "finished requests beyond the first window were never found"
    for req in mpi.started:
        req.done = True
    while not all(f.done() for f in futs):
        engine.poll()
        polls += 1
        assert polls < 100
    assert engine.stats().in_flight == 0


def test_a_long_lived_request_leaves_no_trail_of_holes(engine, mpi):
    """One request stays in flight (a receive posted for a stop message, on another
    communicator) while 2,000 operations of the same backend run one after another: the
    track's lists stay bounded, and each new operation is tested by the first poll after it
    finished (before, every operation left a hole behind the old request that only the old
    request's end compacted: the lists grew with every operation, and the rotating window
    walked the holes, so a new operation waited len/64 polls to be tested)."""
    from mcrdl.engine._tracks import WINDOW

    submit(engine, mpi, "allreduce", comm="other")  # started[0]: never finishes here
    track = engine.lanes()[0].track
    longest = 0
    for i in range(1, 2001):
        fut = submit(engine, mpi, "allreduce")
        mpi.finish(mpi.started[i])
        engine.poll()
        assert fut.done(), f"operation {i} was not tested by the first poll after it finished"
        longest = max(longest, len(track.futs))
    assert longest <= 2 * WINDOW + 2, longest
    assert track.live == 1


def test_random_adds_finishes_and_removals_keep_every_request_tested():
    """Seeded random runs of issues, completions in any order and removals (cancels): the
    track's counts stay right, a hole never reaches the backend's test, and every request
    is found within a bounded number of polls. (A compaction that dropped the trailing
    holes left ``first`` past the end once: later requests were never tested, a hang.)"""
    import random

    from mcrdl.engine._tracks import Track

    class Backend:
        class capabilities:  # noqa: N801 - quacks like Capabilities
            self_progressing = False

        def __init__(self):
            self.done = set()

        def test(self, reqs):
            assert None not in reqs
            return [(i, None) for i, r in enumerate(reqs) if r in self.done]

    for seed in range(400):
        rng = random.Random(seed)
        backend = Backend()
        track = Track(backend)  # type: ignore[arg-type]
        live, found, n = {}, set(), 0
        for _ in range(rng.randint(1, 300)):
            roll = rng.random()
            if roll < 0.45:
                n += 1
                track.add(n, f"r{n}")  # type: ignore[arg-type]
                live[n] = f"r{n}"
            elif roll < 0.8 and live:
                backend.done.add(live.pop(rng.choice(list(live))))
            elif live:
                fut = rng.choice(list(live))
                assert track.remove(fut) == live.pop(fut)  # type: ignore[arg-type]
            found.update(f for f, _ in track.poll())
            assert track.live == sum(f is not None for f in track.futs[track.first:])
        backend.done.update(live.values())
        for _ in range(2 + n // 64):
            found.update(f for f, _ in track.poll())
        assert track.live == 0 and set(live) <= found, seed
