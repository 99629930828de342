"""The trainers people use, over "mcrdl" and unmodified, end where they end over torch's gloo.

PyTorch Lightning's DDP strategy (under ``mpiexec``, and under Lightning's own launcher) with
``sync_dist`` logging, early stopping and a checkpoint; DeepSpeed's ZeRO stages 1, 2 and 3
under torchrun; accelerate and the transformers Trainer over a group made first
(``tests/ranks/hf_check.py``). Each runs at 2 ranks on both backends, side by side (the runs
mostly start processes and import), and compares what they ended with: at 2 ranks a sum has
one order, so the parameters are equal bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import finish, start_ranks

pytestmark = pytest.mark.multirank


def _run_all(jobs: dict[str, tuple[list[str], str]], tmp: Path) -> dict[str, dict]:
    """Run each job ``name: (argv, launcher)`` at 2 ranks, all at once; what each wrote to
    its output file (the last argument of a script under tests/, else ``--out``)."""
    started = {}
    for name, (argv, launcher) in jobs.items():
        out = tmp / f"{name}.json"
        argv = [*argv, str(out)] if argv[0].startswith("tests/") else [*argv, "--out", str(out)]
        started[name] = (start_ranks(2, argv, launcher=launcher), out)
    ends = {}
    for name, (proc, out) in started.items():
        done = finish(proc, 300)
        assert done.returncode == 0 and out.exists(), (
            f"{name}:\n{(done.stdout + done.stderr)[-8000:]}")
        ends[name] = json.loads(out.read_text())
    return ends


def test_lightning_ddp_over_mcrdl_ends_as_over_gloo(tmp_path):
    """Under mpiexec and under Lightning's own launcher, against gloo under mpiexec."""
    pytest.importorskip("lightning")
    ends = _run_all({"gloo": (["examples/lightning_ddp.py", "--backend", "gloo"], "mpi"),
                     "mpi": (["examples/lightning_ddp.py"], "mpi"),
                     "lightning": (["examples/lightning_ddp.py"], "self")}, tmp_path)
    reference = ends["gloo"]
    for launcher in ("mpi", "lightning"):
        got = ends[launcher]
        assert (got["backend"], got["world_size"]) == ("mcrdl", 2), launcher
        # Early stopping ended both runs at one epoch, well before the last one.
        assert 0 < got["stopped_epoch"] == reference["stopped_epoch"] < 29, launcher
        assert got["metrics"] == reference["metrics"], launcher  # logged with sync_dist=True
        assert got["checkpoint"] == reference["checkpoint"], launcher
        assert got["checkpoint_params"] == reference["checkpoint_params"], launcher
        assert got["params"] == reference["params"], launcher


def test_deepspeed_zero_stages_over_mcrdl_end_as_over_gloo(tmp_path):
    pytest.importorskip("deepspeed")
    ends = _run_all({b: (["examples/deepspeed_zero.py", "--backend", b], "torchrun")
                     for b in ("mcrdl", "gloo")}, tmp_path)
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
    ends = _run_all({b: (["tests/ranks/hf_check.py", b], "torchrun")
                     for b in ("mcrdl", "gloo")}, tmp_path)
    assert ends["mcrdl"]["backend"] == "mcrdl"
    assert ends["mcrdl"]["accelerate"] == ends["gloo"]["accelerate"]
    assert ends["mcrdl"]["trainer"] == ends["gloo"]["trainer"]
