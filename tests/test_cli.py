"""python -m mcrdl bench / tune, run for real at 2 ranks on a small sweep."""

from __future__ import annotations

import json
import re

import pytest

from mcrdl.tuning import TuningTable
from tests.launch import run_ranks

pytestmark = pytest.mark.multirank

SMALL = ["--sizes", "4:1K", "--budget", "0.01", "--warmup", "2", "--no-progress"]


def _run(args, timeout=240):
    proc = run_ranks(2, ["-m", "mcrdl", *args], timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


def test_bench_json_and_plot(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    _run(["bench", "--ops", "allreduce,alltoall,barrier", "--dtypes", "float32,bfloat16",
          "--format", "json", "--output", str(out), "--plot", str(png), *SMALL])
    doc = json.loads(out.read_text())
    assert doc["meta"]["world_size"] == 2 and "MPICH" in doc["meta"]["mpi_library"]
    points = doc["points"]
    backends = {p["backend"] for p in points}
    assert backends == {"mpi", "gloo", "auto", "raw-mpi4py", "raw-torch"}
    ar = [p for p in points if p["op"] == "allreduce" and p["dtype"] == "float32"]
    assert sorted({p["nbytes"] for p in ar}) == [4, 16, 64, 256, 1024]
    for p in ar:
        assert p["time_us"] > 0 and p["iters"] >= 3
        assert p["busbw"] == pytest.approx(p["algbw"] * 2 * (2 - 1) / 2, rel=1e-3, abs=1e-4)
    # raw MPI has no bfloat16 reduction: that point is left out, not faked
    assert not [p for p in points if p["backend"] == "raw-mpi4py" and p["dtype"] == "bfloat16"
                and p["op"] == "allreduce"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_table_and_osu_layouts(tmp_path):
    # Read the reports from files: the launcher may split forwarded stdout mid-line.
    path = tmp_path / "table.txt"
    _run(["bench", "--ops", "broadcast", "--backends", "mpi", "--no-raw", "--output", str(path),
          *SMALL])
    table = path.read_text()
    assert re.search(r"#\s+size\s+count\s+type\s+redop\s+root\s+time\s+algbw\s+busbw", table)
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+float\s+none\s+0\s+[\d.]+\s+[\d.]+"
                      r"\s+[\d.]+\s+mpi$", table, re.M)
    assert [int(r[0]) for r in rows] == [4, 16, 64, 256, 1024]
    path = tmp_path / "osu.txt"
    _run(["bench", "--ops", "allreduce", "--backends", "mpi", "--no-raw", "--format", "osu",
          "--output", str(path), *SMALL])
    osu = path.read_text()
    assert "# Size" in osu and "Latency (us)" in osu
    assert len(re.findall(r"^\d+\s+[\d.]+$", osu, re.M)) == 5


def test_tune_writes_a_table_that_init_accepts(tmp_path):
    path = tmp_path / "t.json"
    out = _run(["tune", "--ops", "allreduce,alltoall", "--dtypes", "float32", "--output",
                str(path), *SMALL])
    assert "wrote" in out
    table = TuningTable.load(str(path))
    assert {e.op for e in table.entries} == {"allreduce", "alltoall"}
    for key in ("mcrdl", "torch", "mpi4py", "mpi_library", "world_size", "host", "date"):
        assert key in table.provenance
    first = [e for e in table.entries if e.op == "allreduce"][0]
    assert first.min_bytes == 0 and set(first.latency_us) == {"mpi", "gloo"}
    # Runner-up over winner: at least 1, except where a single noisy size was given its
    # neighbours' choice (within the table's noise factor, 1.10): then down to 1/1.10.
    assert first.margin >= round(1 / 1.10, 3)
