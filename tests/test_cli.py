"""python -m mcrdl bench / tune, run for real at 2 ranks on a small sweep."""

from __future__ import annotations

import json
import re

import pytest

from mcrdl.tuning import TuningTable
from tests import died_idle
from tests.launch import run_ranks

pytestmark = pytest.mark.multirank

QUICK = ["--sizes", "4:1K", "--budget", "0.01", "--warmup", "2"]
SMALL = [*QUICK, "--no-progress"]
#: tqdm's bar at its end: "100%|##########| 5/5 [00:00<00:00, ...point/s, ...]".
BAR = re.compile(r"100%\|\S+\| (\d+)/\1 \[")


def _run(args, timeout=240, progress=False):
    proc = run_ranks(2, ["-m", "mcrdl", *args], timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    # The bar only where asked: under mpiexec the ranks write to pipes, not a terminal.
    assert bool(BAR.search(proc.stderr)) is progress, proc.stderr[-3000:]
    return proc.stdout


def test_bench_json_and_plot(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    _run(["bench", "--ops", "allreduce,alltoall,barrier", "--dtypes", "float32,bfloat16",
          "--format", "json", "--output", str(out), "--plot", str(png), *QUICK, "--progress"],
         progress=True)
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
                str(path), *QUICK])  # no flag: no bar, since stderr is not a terminal
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


def _made_up_trace(path):
    from mcrdl.observe._recorder import trace_events

    def rec(op, backend, seq, issue, done):
        return {"op": op, "seq": seq, "backend": backend, "comm": "world",
                "lane": f"{backend}:world", "size": 2, "state": "done", "dtype": "float32",
                "bytes": 4096, "submit": issue, "issue": issue, "done": done}

    payload = {"offset": 0.0, "skew_bound": 0.0, "t0": 0.0, "edges": [],
               "records": [rec("allreduce", "mpi", 1, 0.000, 0.002),
                           rec("alltoall", "gloo", 2, 0.001, 0.004)],
               "spans": [("forward", 0.0, 0.003, "MainThread")]}
    path.write_text(json.dumps({"traceEvents": trace_events([payload, payload], 0.0)}))


def test_trace_summary_and_plot(tmp_path):
    from mcrdl.__main__ import main

    trace = tmp_path / "trace.json"
    _made_up_trace(trace)
    assert main(["trace", "summary", str(trace)]) == 0
    png = tmp_path / "timeline.png"
    assert main(["trace", "plot", str(trace), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_summary_numbers(tmp_path, capsys):
    from mcrdl.__main__ import main

    trace = tmp_path / "trace.json"
    _made_up_trace(trace)
    main(["trace", "summary", str(trace)])
    out = capsys.readouterr().out
    # mpi busy [0, 2] ms, gloo [1, 4] ms: 4 ms of communication; the span [0, 3] ms covers
    # [0, 3] of it: 3 ms.
    assert re.search(r"0  lane mpi:world\s+1\s+2\.00", out), out
    assert re.search(r"0  lane gloo:world\s+1\s+3\.00", out), out
    assert "rank 0: 3.00 of 4.00 ms of communication ran inside user spans" in out, out


def test_trace_refuses_a_file_that_is_not_a_trace(tmp_path, capsys):
    from mcrdl.__main__ import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": []}))
    assert main(["trace", "summary", str(bad)]) == 2
    assert "is not a trace-event file" in capsys.readouterr().err


def test_info_names_torch_and_the_mpi_library_loaded():
    """``python -m mcrdl``: the versions, and the MPI library mpi4py loaded (a site's, or
    the mpich wheel's), without starting MPI."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mcrdl"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("mcrdl 0.1.0\ntorch 2."), out
    assert "within the range mcrdl has been run with, 2.11 to 2.13" in out, out
    assert re.search(r"^mpi4py \S+, MPI \d\.\d: \S", out, re.M), out
    assert re.search(r"^MPI library loaded from: \S*libmpi", out, re.M), out


def test_the_torch_range_mcrdl_has_been_run_with():
    from mcrdl.core._versions import torch_in_range

    assert torch_in_range("2.13.0+cpu") and torch_in_range("2.11.0a0+git1234")
    assert not torch_in_range("2.10.1") and not torch_in_range("2.14.0")
    assert not torch_in_range("nightly")


def test_importing_mcrdl_starts_no_mpi_thread_or_socket():
    """A fresh process: importing mcrdl and its torch and testing parts leaves MPI
    unloaded, one thread, and no socket open (everything starts in init())."""
    import subprocess
    import sys

    code = ("import os, sys, threading\n"
            "import mcrdl, mcrdl.torch, mcrdl.testing\n"
            "fds = [os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')\n"
            "       if os.path.exists(f'/proc/self/fd/{fd}')]\n"
            "print(threading.active_count(), 'mpi4py.MPI' in sys.modules,\n"
            "      sum(f.startswith('socket:') for f in fds))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["1", "False", "0"], out


def _launch(mode, tmp_path, **env):
    """``python -m mcrdl run -n 3 tests/ranks/launched.py MODE``, finished."""
    return run_ranks(3, ["tests/ranks/launched.py", mode, str(tmp_path)], timeout=120,
                     launcher="mcrdl", env={"MCRDL_TIMEOUT": "5", **env})


def test_run_starts_the_ranks_from_a_store_of_its_own(tmp_path):
    """torchrun's environment, its store in the launcher: mcrdl and torch's env:// start."""
    proc = _launch("ok", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    reports = [p.read_text().splitlines()[0] for p in sorted(tmp_path.glob("rank*.txt"))]
    assert reports == ["launcher=torchrun size=3 first=[3.0, 3.0] torch=[3.0, 3.0, 3.0]"] * 3


def test_run_leaves_the_others_running_and_tells_them_when_a_rank_dies(tmp_path):
    """Rank 1 is killed while ranks 0 and 2 have nothing in flight. They run on (torchrun's
    agent would stop them), and the launcher tells them at once: their next allreduce on the
    world fails without waiting, with PeerLostError naming rank 1, while the communicator of
    the two goes on. Then they shrink the world to themselves and go on there. The job's
    status is the killed rank's."""
    proc = _launch("die", tmp_path, MCRDL_TRACE=str(tmp_path / "trace.json"),
                   MCRDL_PROGRESS_THREAD="0")  # (tests/ranks/launched.py says why)
    assert proc.returncode == 128 + 9, (proc.stdout + proc.stderr)[-6000:]
    assert "mcrdl run: rank 1 was ended by SIGKILL; the 2 still running go on" in proc.stderr
    died_idle.check(tmp_path, 1, [0, 2], "rank 1 is gone: its process was ended by SIGKILL",
                    "gloo", proc.stderr[-6000:])


def test_run_refuses_a_job_of_no_ranks_or_no_command():
    from mcrdl.bootstrap._run import run

    with pytest.raises(ValueError, match=r"-n 0: a job needs at least one rank"):
        run(0, ["x.py"])
    with pytest.raises(ValueError, match=r"no command: pass a script"):
        run(2, [])
