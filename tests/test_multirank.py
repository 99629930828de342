"""The multi-rank suites, each run in one launch per world size (2 and 4 ranks)."""

from __future__ import annotations

import re

import pytest

from tests.launch import run_ranks, run_suite

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("n", [2, 4])
def test_contract(n):
    run_suite(n, "tests/multirank/test_contract.py")


@pytest.mark.parametrize("n", [2, 4])
def test_semantics(n):
    run_suite(n, "tests/multirank/test_semantics.py")


def _overlap(progress_thread: str) -> list[str]:
    proc = run_ranks(2, ["tests/multirank/overlap_check.py"], timeout=120,
                     env={"MCRDL_PROGRESS_THREAD": progress_thread})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.findall(r"overlap rank=\d+ mpi_done=\w+ gloo_done=\w+", proc.stdout)


def test_communication_advances_during_compute():
    lines = _overlap("1")
    assert len(lines) == 2 and all("mpi_done=True gloo_done=True" in line for line in lines), lines


def test_without_the_progress_thread_nothing_advances_during_compute():
    """The negative control: the check above fails when the guarantee is switched off."""
    lines = _overlap("0")
    assert len(lines) == 2 and all("mpi_done=False gloo_done=False" in line for line in lines), lines


def test_under_torchrun_gloo_only():
    proc = run_ranks(2, ["tests/multirank/torchrun_check.py"], timeout=120, launcher="torchrun")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("size=2 ok") == 2, out[-6000:]
