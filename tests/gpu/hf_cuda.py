"""accelerate and the transformers Trainer on CUDA, naming the backend: on CUDA both keep a
backend name they do not know (accelerate rewrites one only on CPU), and under torchrun
(``LOCAL_RANK`` set) both start the process group with it, even in a world of one:

    MCRDL_BACKENDS=gloo,nccl torchrun --nproc-per-node 1 tests/gpu/hf_cuda.py BACKEND OUT

Trains the small model of ``tests/ranks/hf_models.py`` with each; writes the parameters and
the backend of the group to OUT (JSON). ``tests/gpu/test_torch_cuda.py`` runs it over "mcrdl"
and over "nccl" and compares.
"""

import gc
import json
import sys

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from tests.ranks.hf_models import Model, accelerate, params, train

backend, out = sys.argv[1], sys.argv[2]
if "mcrdl" not in dist.Backend.backend_list:  # run from a source tree: no entry point
    import _mcrdl_torch

    _mcrdl_torch.register()

accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=backend)])
assert accelerator.device.type == "cuda" and dist.get_backend() == backend, (
    accelerator.device, dist.get_backend())
report = {"backend": dist.get_backend(), "accelerate": accelerate(accelerator)}
del accelerator
dist.destroy_process_group()

model = Model()
args, trainer = train(model, ddp_backend=backend)
assert dist.get_backend() == backend and next(model.parameters()).device.type == "cuda"
report["trainer"] = params(model)
del trainer
gc.collect()
with open(out, "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
