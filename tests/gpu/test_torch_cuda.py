"""torch.distributed over "mcrdl" on CUDA tensors (``tests/gpu/torch_cuda.py``), under
torchrun on one GPU: a world of one with nccl up beside gloo, and two ranks sharing the GPU
over gloo staged through host memory (NCCL refuses two ranks on one GPU).

Marked ``gpu`` and skipped where CUDA is missing; ``tests/gpu/run.sh`` runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

SCRIPT = str(Path(__file__).with_name("torch_cuda.py"))


@pytest.mark.parametrize(("ranks", "backends"), [(1, "gloo,nccl"), (2, "gloo")])
def test_torch_collectives_ddp_and_fsdp2_on_cuda(ranks, backends):
    from tests.launch import run_ranks

    proc = run_ranks(ranks, [SCRIPT], timeout=140, launcher="torchrun",
                     env={"MCRDL_BACKENDS": backends})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    assert f"torch cuda ok: {ranks} ranks" in proc.stdout
    print(proc.stdout)


def test_accelerate_and_the_trainer_name_mcrdl_on_cuda_and_end_as_over_nccl(tmp_path):
    """A world of one under torchrun: both start the group with the name they are given."""
    import json

    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from tests.launch import run_ranks

    ends = {}
    for backend in ("mcrdl", "nccl"):
        out = tmp_path / f"{backend}.json"
        proc = run_ranks(1, [str(Path(__file__).with_name("hf_cuda.py")), backend, str(out)],
                         timeout=140, launcher="torchrun", env={"MCRDL_BACKENDS": "gloo,nccl"})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
        ends[backend] = json.loads(out.read_text())
    assert ends["mcrdl"]["backend"] == "mcrdl"
    assert ends["mcrdl"]["accelerate"] == ends["nccl"]["accelerate"]
    assert ends["mcrdl"]["trainer"] == ends["nccl"]["trainer"]
