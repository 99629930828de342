"""The comms log's arithmetic and the trace's shape (mcrdl.observe._recorder), from made-up records."""

from __future__ import annotations

import pytest

from mcrdl.observe._recorder import (
    algbw_bytes,
    bucket,
    busbw_factor,
    format_summary,
    summarize,
    trace_events,
)


@pytest.mark.parametrize(("op", "n", "factor"), [
    ("allreduce", 2, 1.0), ("allreduce", 4, 1.5), ("allreduce", 8, 1.75),
    ("allgather", 4, 0.75), ("reduce_scatter", 4, 0.75), ("alltoall", 8, 0.875),
    ("broadcast", 4, 1.0), ("reduce", 4, 1.0), ("send", 2, 1.0), ("allreduce", 1, 1.0),
])
def test_busbw_factors_are_nccl_tests(op, n, factor):
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_algbw_divides_an_allgathers_whole_output_and_other_ops_input():
    assert algbw_bytes("allgather", 1000, 4) == 4000
    assert algbw_bytes("reduce_scatter", 4000, 4) == 4000
    assert algbw_bytes("allreduce", 1000, 4) == 1000


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (0, 1, 4, 5, 4096, 4097)] == [0, 1, 4, 8, 4096, 8192]


def _rec(op, nbytes, issue, done, size=4, backend="mpi", state="done"):
    return {"op": op, "seq": 1, "backend": backend, "comm": "world", "lane": f"{backend}:world",
            "size": size, "state": state, "dtype": "float32", "bytes": nbytes,
            "submit": issue, "issue": issue, "done": done}


def test_summary_rows_match_hand_computed_figures():
    # Rank 0: two 1 MB allreduces of 1 ms and 4 ms; rank 1: two of 1 ms; a failed one is
    # left out.
    ranks = [[_rec("allreduce", 10**6, 0.0, 1e-3), _rec("allreduce", 10**6, 1.0, 1.004)],
             [_rec("allreduce", 10**6, 0.0, 1e-3), _rec("allreduce", 10**6, 1.0, 1.001),
              _rec("allreduce", 10**6, 2.0, 2.5, state="failed")]]
    (row,) = summarize(ranks)
    assert row["count"] == 2 and row["ranks"] == 2
    assert row["mean_us"] == pytest.approx(1750.0)
    assert row["total_s"] == pytest.approx(7e-3)
    assert row["algbw"] == pytest.approx(1e6 / 1.75e-3 / 1e9)   # S/t, GB/s
    assert row["busbw"] == pytest.approx(1e6 / 1.75e-3 / 1e9 * 1.5)  # x 2(n-1)/n at n = 4
    assert row["slowest_rank"] == 0 and row["slowest_mean_us"] == pytest.approx(2500.0)
    assert row["bucket"] == 1 << 20
    text = format_summary([row])
    assert "allreduce" in text and "0.857" in text


def test_the_slowest_rank_is_the_one_with_the_largest_mean():
    ranks = [[_rec("alltoall", 64, 0.0, 1e-5)], [_rec("alltoall", 64, 0.0, 5e-5)]]
    assert summarize(ranks)[0]["slowest_rank"] == 1


def test_trace_has_a_process_per_rank_a_track_per_lane_flows_spans_and_aligned_clocks():
    def payload(offset):
        return {"offset": offset, "skew_bound": 0.0, "t0": 10.0,
                "records": [
                    {**_rec("allreduce", 4, 10.001, 10.002), "seq": 1},
                    {**_rec("allreduce", 4, 10.003, 10.004, backend="gloo"), "seq": 2,
                     "submit": 10.0015},
                ],
                "edges": [("mpi:world", 1, "gloo:world", 2)],
                "spans": [("forward", 10.0, 10.0005, "MainThread")]}

    events = trace_events([payload(0.0), payload(0.5)], t0=10.0)
    procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0, 1}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(r, n) for r in (0, 1) for n in ("user spans", "lane mpi:world",
                                                       "lane gloo:world")}
    flows = [e for e in events if e["ph"] in "sf"]
    assert len(flows) == 4  # one arrow per rank: start at mpi's end, finish at gloo's issue
    ops = [e for e in events if e["ph"] == "X" and e.get("cat") == "mpi"]
    # Rank 1's clock reads 0.5 s behind rank 0's: its events move 0.5 s later.
    assert [e["ts"] for e in ops] == [pytest.approx(1000.0), pytest.approx(501000.0)]
    queued = [e for e in events if e.get("cat") == "queued"]
    assert len(queued) == 2 and queued[0]["dur"] == pytest.approx(1500.0)
    spans = [e for e in events if e.get("cat") == "span"]
    assert [s["name"] for s in spans] == ["forward", "forward"]


def test_operations_appear_in_torchs_profiler_while_it_runs():
    import torch
    from torch.profiler import profile

    import mcrdl

    comm = mcrdl.init()
    try:
        t = torch.ones(16)
        comm.allreduce(t).wait()  # before the profiler: not recorded
        with profile() as prof:
            futs = [comm.allreduce(t) for _ in range(3)]
            for f in futs:
                f.wait()
            comm.allgather(t).wait()
        comm.allreduce(t).wait()  # after it: not recorded
        names = [e.name for e in prof.events() if e.name.startswith("mcrdl.")]
        assert sorted(names) == ["mcrdl.allgather"] + ["mcrdl.allreduce"] * 3
    finally:
        mcrdl.finalize()


def test_log_records_carry_each_operations_figures():
    import torch

    import mcrdl

    comm = mcrdl.init(log=True)
    try:
        t = torch.ones(256)
        comm.allreduce(t).wait()
        comm.allgather(t).wait()
        recs = [r for r in comm.log_records() if r["op"] in ("allreduce", "allgather")][-2:]
        assert [(r["op"], r["bytes"], r["dtype"], r["state"]) for r in recs] == [
            ("allreduce", 1024, "float32", "done"), ("allgather", 1024, "float32", "done")]
        for r in recs:
            assert r["submit"] <= r["issue"] <= r["done"]
            assert r["latency_us"] == pytest.approx((r["done"] - r["issue"]) * 1e6)
            assert r["algbw"] == pytest.approx(1024 / (r["latency_us"] * 1e-6) / 1e9)
    finally:
        mcrdl.finalize()
    with pytest.raises(mcrdl.MCRDLError, match="the comms log is off"):
        comm2 = mcrdl.init()
        try:
            comm2.log_records()
        finally:
            mcrdl.finalize()


def test_clock_alignment_finds_a_known_offset_to_rank_0():
    """Two ranks as threads over one store, rank 0's clock 5 s ahead: rank 1's offset is
    +5 s, within its recorded bound (the real runs share one machine's clock: offset ~0)."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from mcrdl.observe._recorder import Recorder

    store = dist.HashStore()
    ahead = SimpleNamespace(now=lambda: time.perf_counter() + 5.0)
    behind = SimpleNamespace(now=time.perf_counter)
    r0, r1 = Recorder(ahead, 0, 2), Recorder(behind, 1, 2)
    t = threading.Thread(target=r0.align, args=(store, 30.0))
    t.start()
    r1.align(store, 30.0)
    t.join()
    assert r0.offset == 0.0
    assert abs(r1.offset - 5.0) <= r1.skew_bound + 1e-3, (r1.offset, r1.skew_bound)


def test_a_rank_that_did_not_report_is_left_out_of_the_trace():
    payload = {"offset": 0.0, "skew_bound": 0.0, "t0": 0.0, "edges": [], "spans": [],
               "records": [_rec("allreduce", 4, 0.001, 0.002)]}
    events = trace_events([payload, None, payload], t0=0.0)
    assert {e["pid"] for e in events} == {0, 2}


def test_gathers_are_numbered_per_member_list():
    """Three ranks as threads over one store: ranks 0 and 1 gather twice on their own
    two-member communicator, then all three gather. Numbered per process instead, rank 0's
    and 1's third gather would wait on keys rank 2 never writes (the members left out)."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from mcrdl.observe._recorder import Recorder

    store = dist.HashStore()
    recs = [Recorder(SimpleNamespace(now=time.perf_counter), r, 3) for r in range(3)]
    out: dict[int, list] = {}

    def rank(r):
        if r < 2:
            for _ in range(2):
                assert recs[r].gather(store, [0, 1], r, r, 10.0, everyone=True) == [0, 1]
        out[r] = recs[r].gather(store, [0, 1, 2], r, r * 10, 2.0, everyone=True)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {r: [0, 10, 20] for r in range(3)}
    assert not store.check(["mcrdl/gather/0-1/1/0"])  # read by both: deleted by member 0
