"""The trainers people use, over "mcrdl" and unmodified, end where they end over torch's gloo.

PyTorch Lightning's DDP strategy (under ``mpiexec``, and under Lightning's own launcher) with
``sync_dist`` logging, early stopping and a checkpoint; DeepSpeed's ZeRO stages 1, 2 and 3
under torchrun; accelerate and the transformers Trainer over a group made first
(``tests/ranks/hf_check.py``). Each runs its example (``examples/lightning_ddp.py``,
``examples/deepspeed_zero.py``) at 2 ranks on both backends and compares what they ended with:
at 2 ranks a sum has one order, so the parameters are equal bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import ROOT, run_ranks

pytestmark = pytest.mark.multirank


def _run(argv: list[str], out: Path, launcher: str) -> dict:
    """Run ``argv`` at 2 ranks; what it wrote to ``out`` (its last argument, or ``--out``)."""
    argv = [*argv, str(out)] if argv[0].startswith("tests/") else [*argv, "--out", str(out)]
    if launcher == "lightning":  # one process; Lightning starts the second itself
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MCRDL_TIMEOUT": "30"}
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180,
                              start_new_session=True)
    else:
        proc = run_ranks(2, argv, timeout=180, launcher=launcher)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-8000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def lightning_over_gloo(tmp_path_factory) -> dict:
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("gloo") / "end.json"
    return _run(["examples/lightning_ddp.py", "--backend", "gloo"], out, "mpi")


@pytest.mark.parametrize("launcher", ["mpi", "lightning"])
def test_lightning_ddp_over_mcrdl_ends_as_over_gloo(lightning_over_gloo, launcher, tmp_path):
    reference = lightning_over_gloo
    got = _run(["examples/lightning_ddp.py"], tmp_path / "end.json", launcher)
    assert (got["backend"], got["world_size"]) == ("mcrdl", 2)
    # Early stopping ended both runs at one epoch, well before the last one.
    assert 0 < got["stopped_epoch"] == reference["stopped_epoch"] < 29
    assert got["metrics"] == reference["metrics"]  # logged with sync_dist=True
    assert got["checkpoint"] == reference["checkpoint"]
    assert got["checkpoint_params"] == reference["checkpoint_params"]
    assert got["params"] == reference["params"]


def test_deepspeed_zero_stages_over_mcrdl_end_as_over_gloo(tmp_path):
    pytest.importorskip("deepspeed")
    ends = {b: _run(["examples/deepspeed_zero.py", "--backend", b], tmp_path / f"{b}.json",
                    "torchrun") for b in ("mcrdl", "gloo")}
    assert ends["mcrdl"]["backend"] == "mcrdl"
    for stage in ("stage1", "stage2", "stage3"):
        got, reference = ends["mcrdl"][stage], ends["gloo"][stage]
        assert got["losses"][-1] < got["losses"][0] / 2, got["losses"]  # it trains
        assert got == reference, stage


def test_accelerate_and_the_hf_trainer_take_a_group_made_first(tmp_path):
    """Both refuse the name "mcrdl" on CPU (accelerate rewrites an unknown backend to gloo
    and raises); over a default group made first they train, as over gloo."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    ends = {b: _run(["tests/ranks/hf_check.py", b], tmp_path / f"{b}.json", "torchrun")
            for b in ("mcrdl", "gloo")}
    assert ends["mcrdl"]["backend"] == "mcrdl"
    assert ends["mcrdl"]["accelerate"] == ends["gloo"]["accelerate"]
    assert ends["mcrdl"]["trainer"] == ends["gloo"]["trainer"]
