"""The one-process benchmark runs as the README says and prints its table."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from .launch import ROOT


def test_floor_benchmark_prints_its_rows():
    proc = subprocess.run(
        [sys.executable, "benchmarks/floor.py", "--iters", "300", "--runs", "1", "--ops",
         "allreduce,alltoall,allgather,broadcast,reduce_scatter"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\w+\s+\w+\s+\d \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \|",
                      proc.stdout, re.M)
    assert len(rows) == 5, proc.stdout
    assert all(float(x) > 0 for row in rows for x in row)


def test_thread_naps_benchmark_prints_its_rows():
    proc = subprocess.run(
        [sys.executable, "benchmarks/thread_naps.py", "--rounds", "1", "--reps", "1",
         "--cases", "one,64 x 4 B,then"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "MCRDL_PROGRESS_THREAD": "1"},  # (what it compares)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^(.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["one 4 B allreduce at a time, per op", "64 x 4 B, per op",
                                    "then 1 MiB over 2 ms of compute"], proc.stdout
    assert all(float(x) > 0 for row in rows for x in row[1:])


@pytest.mark.slow
def test_footprint_benchmark_counts_a_call():
    """benchmarks/footprint.py under valgrind (about two minutes a call): its row has counts."""
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    proc = subprocess.run(
        [sys.executable, "benchmarks/footprint.py", "--calls", "mcrdl", "--n", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = re.search(r"^allreduce\s+mcrdl\s+\|\s+(\d+) \|\s+(\d+)\s+(\d+) \|\s+(\d+)", proc.stdout,
                    re.M)
    assert row is not None, proc.stdout
    assert int(row.group(1)) > 1000 and int(row.group(4)) > 0
