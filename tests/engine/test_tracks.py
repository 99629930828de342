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
        engine.poll_once()
        polls += 1
        assert polls < 50, "finished requests beyond the first window were never found"
    for req in mpi.started:
        req.done = True
    while not all(f.done() for f in futs):
        engine.poll_once()
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
        engine.poll_once()
        assert fut.done(), f"operation {i} was not tested by the first poll after it finished"
        longest = max(longest, len(track.futs))
    assert longest <= 2 * WINDOW + 2, longest
    assert track.live == 1
