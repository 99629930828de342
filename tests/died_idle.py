"""What the survivors of tests/ranks/launched.py's ``die`` mode report, checked: run by
``python -m mcrdl run`` (tests/test_cli.py) and by Open MPI's ``mpiexec --with-ft ulfm``
(tests/test_survivors.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path


def check(out: Path, victim: int, survivors: list[int], cause: str, backend: str,
          log: str) -> None:
    """Each survivor's report in ``out``: its allreduce on the world after ``victim`` died
    failed at once with PeerLostError saying ``cause``, the survivors' own communicator went
    on, and on the shrunk world an allreduce, a named one and a split ran (``backend``'s
    lanes in the flight recorder), a break there reached the other survivor (rule 7),
    finalize did not wait for the dead, and the trace has every survivor."""
    reports = {p.name: p.read_text() for p in out.glob("rank*.txt")}
    assert sorted(reports) == [f"rank{r}.txt" for r in survivors], log
    members = ", ".join(map(str, survivors))
    total = float(sum(survivors))
    for text in reports.values():
        after, pair, outcome = re.search(
            rf"after=([\d.]+) pair=(.*) lived after rank {victim} died: (.*)", text).groups()
        assert outcome.startswith("PeerLostError: allreduce#") and cause in outcome, text
        assert float(after) < 0.5 and pair == "[2.0, 2.0]", text
        assert re.search(rf"shrunk: members=\[{members}\] rank=[01] sum=\[{total}, {total}\] "
                         r"named=\[2.0\] split=1$", text, re.M), text
        # Told of the break on their shrunk world, not timed out.
        broken = re.search(r"broken after=([\d.]+) (\w+)", text)
        assert broken[2] == "CommBrokenError" and float(broken[1]) < 3, text
        # The trace is gathered from the live ranks, without waiting for the dead one.
        assert float(re.search(r"finalize=([\d.]+)", text)[1]) < 3, text
    for rank in survivors:  # the flight recorder knows the survivors' communicator
        dump = json.loads((out / f"fr-{rank}.json").read_text())
        lanes = {lane["lane"]: lane["submitted"] for lane in dump["lanes"]}
        # its allreduce and the split's allgather; the named allreduce on its own lane; the
        # split's groups (gloo's made through the store the survivors meet through)
        assert lanes.get(f"{backend}:world.s1") == 2, lanes
        assert lanes.get(f"{backend}:world.s1#named"), lanes
        assert any(lane.startswith("gloo:world.s1.1c") for lane in lanes), lanes
    trace = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if "pid" in e} >= set(survivors), (
        trace["otherData"])
