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
