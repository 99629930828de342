"""``trace explain`` on made-up dumps (the real ones: tests/test_multirank.py)."""

from __future__ import annotations

import json

import pytest

from mcrdl.observe._explain import explain, load_dumps


def _op(op, seq, index, lane, age=2.0, state="ISSUED", peer=None, tag=0):
    out = {"op": op, "seq": seq, "state": state, "index": index, "name": None, "bytes": 16,
           "issued": state == "ISSUED", "age_s": age, "lane": lane, "comm": lane.split(":")[1]}
    if peer is not None:
        out["peer"], out["tag"] = peer, tag
    return out


def _lane(key, members, submitted, unfinished=()):
    backend, comm = key.split(":")
    return {"lane": key, "backend": backend, "comm": comm, "named": False, "rank": 0,
            "size": len(members), "members": members, "broken": None, "submitted": submitted,
            "unfinished": list(unfinished), "finished": []}


def _dump(rank, lanes, waiting=()):
    return {"rank": rank, "size": 3, "reason": "test", "time": 0.0, "lanes": lanes,
            "waiting_on": list(waiting)}


def test_a_skipped_collective_names_its_issuers_the_missing_rank_and_its_wait():
    stuck = _op("allreduce", 5, 2, "mpi:world")
    other = _op("allreduce", 1, 1, "mpi:pair")
    dumps = {
        0: _dump(0, [_lane("mpi:world", [0, 1, 2], 2, [stuck]), _lane("mpi:pair", [0, 1], 0)],
                 [stuck]),
        1: _dump(1, [_lane("mpi:world", [0, 1, 2], 1), _lane("mpi:pair", [0, 1], 1, [other])],
                 [other]),
        2: _dump(2, [_lane("mpi:world", [0, 1, 2], 2, [stuck])], [stuck]),
    }
    text = explain(dumps)
    assert "stuck: allreduce#5 at position 2 of lane mpi:world" in text
    assert "issued by ranks [0, 2]" in text
    assert ("not arrived: rank 1 (it submitted 1 operation(s) on this lane); it is blocked"
            " waiting for allreduce#1 on mpi:pair") in text
    # ...and on the pair, rank 0 never issued what rank 1 waits for:
    assert "stuck: allreduce#1 at position 1 of lane mpi:pair" in text
    assert "not arrived: rank 0 (it submitted 0 operation(s) on this lane)" in text
    assert "a cycle: rank 0 -> rank 1 -> rank 0" in text  # 0 waits for 1 on world, 1 for 0


def test_a_rank_with_nothing_in_flight_is_said_to_have_not_submitted_it():
    stuck = _op("barrier", 3, 1, "gloo:world")
    dumps = {0: _dump(0, [_lane("gloo:world", [0, 1], 1, [stuck])], [stuck]),
             1: _dump(1, [_lane("gloo:world", [0, 1], 0)])}
    text = explain(dumps)
    assert "not arrived: rank 1" in text and "has not submitted the operation" in text
    assert "cycle" not in text


def test_a_rank_without_a_dump_is_named():
    stuck = _op("allreduce", 3, 1, "mpi:world")
    text = explain({0: _dump(0, [_lane("mpi:world", [0, 1], 1, [stuck])], [stuck])})
    assert "not arrived: rank 1 (no record of this lane); no dump from it" in text


def test_receives_head_to_head_name_peer_and_tag_and_the_cycle():
    """Both ranks receive first: each waits for a send the other has not posted."""
    r0 = _op("recv", 3, 0, "mpi:world", peer=1, tag=7)
    r1 = _op("recv", 3, 0, "mpi:world", peer=0, tag=9)
    text = explain({0: _dump(0, [_lane("mpi:world", [0, 1], 2, [r0])], [r0]),
                    1: _dump(1, [_lane("mpi:world", [0, 1], 2, [r1])], [r1])})
    assert ("stuck: recv#3 on rank 0 from rank 1, tag 7, on lane mpi:world (communicator "
            "world, issued, 2.0 s)\n  rank 1 has not posted its send with tag 7; it is blocked "
            "waiting for recv#3 on mpi:world (issued, 2.0 s)") in text, text
    assert "stuck: recv#3 on rank 1 from rank 0, tag 9" in text
    assert "a cycle: rank 0 -> rank 1 -> rank 0" in text
    assert "nothing is stuck" not in text


def test_a_collective_and_a_receive_waiting_on_each_other_are_a_cycle():
    """Rank 0 blocks in an allreduce that rank 1 has not issued; rank 1 blocks in a receive
    from rank 0, which sends only after the allreduce."""
    coll = _op("allreduce", 4, 2, "mpi:world")
    recv = _op("recv", 4, 0, "gloo:world", peer=0, tag=1)
    text = explain({0: _dump(0, [_lane("mpi:world", [0, 1], 2, [coll])], [coll]),
                    1: _dump(1, [_lane("mpi:world", [0, 1], 1),
                                 _lane("gloo:world", [0, 1], 0, [recv])], [recv])})
    assert "stuck: allreduce#4 at position 2 of lane mpi:world" in text
    assert "not arrived: rank 1 (it submitted 1 operation(s) on this lane); it is blocked " \
           "waiting for recv#4 on gloo:world" in text, text
    assert "rank 0 has not posted its send with tag 1; it is blocked waiting for " \
           "allreduce#4 on mpi:world" in text, text
    assert "a cycle: rank 0 -> rank 1 -> rank 0" in text


def test_a_message_both_sides_posted_is_in_the_backend_and_no_cycle():
    send = _op("send", 2, 0, "mpi:world", peer=1, tag=5)
    recv = _op("recv", 2, 0, "mpi:world", peer=0, tag=5)
    text = explain({0: _dump(0, [_lane("mpi:world", [0, 1], 1, [send])], [send]),
                    1: _dump(1, [_lane("mpi:world", [0, 1], 1, [recv])], [recv])})
    assert "rank 1 posted its receive: both sides are in the backend" in text, text
    assert "rank 0 posted its send: both sides are in the backend" in text, text
    assert "cycle" not in text


def test_a_receive_from_any_source_is_matched_against_every_ranks_sends():
    anyone = _op("recv", 2, 0, "mpi:world", peer="any", tag=5)
    text = explain({0: _dump(0, [_lane("mpi:world", [0, 1, 2], 1, [anyone])], [anyone]),
                    1: _dump(1, [_lane("mpi:world", [0, 1, 2], 1)]),
                    2: _dump(2, [_lane("mpi:world", [0, 1, 2], 1)])})
    assert "stuck: recv#2 on rank 0 from any rank, tag 5" in text, text
    assert "no rank has posted a send of tag 5 to it" in text, text
    send = _op("send", 2, 0, "mpi:world", peer=0, tag=5)
    text = explain({0: _dump(0, [_lane("mpi:world", [0, 1, 2], 1, [anyone])], [anyone]),
                    1: _dump(1, [_lane("mpi:world", [0, 1, 2], 1)]),
                    2: _dump(2, [_lane("mpi:world", [0, 1, 2], 1, [send])], [send])})
    assert "a rank posted a send of tag 5 to it: both sides are in the backend" in text, text
    assert "rank 0 posted its receive: both sides are in the backend" in text, text


def test_nothing_stuck():
    assert "nothing is stuck" in explain({0: _dump(0, [_lane("mpi:world", [0, 1], 4)])})


def test_load_dumps_keeps_each_ranks_last_and_refuses_other_files(tmp_path):
    f = tmp_path / "fr-0.json"
    f.write_text(json.dumps(_dump(0, [], [])) + "\n"
                 + json.dumps({**_dump(0, [], []), "reason": "later"}) + "\n")
    assert load_dumps([str(f)])[0]["reason"] == "later"
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": []}\n')
    with pytest.raises(ValueError, match="is not a flight-recorder dump"):
        load_dumps([str(bad)])
