"""accelerate and the transformers Trainer on CPU over a group made first (tests/test_trainers.py).

    torchrun --nproc-per-node 2 tests/ranks/hf_check.py BACKEND OUT

Both rewrite a backend name they do not know to "gloo" on CPU and then raise (accelerate's
``PartialState``: "Your assigned backend mcrdl is not available, please use gloo"), with or
without a group already made. The workaround: make the default group first, and let them take
it (``Accelerator(cpu=True)``; ``TrainingArguments(use_cpu=True)`` without ``ddp_backend``).
This script checks the refusal, then trains a small model with each over the group it made on
BACKEND; rank 0 writes the parameters to OUT (JSON).
"""

import gc
import json
import sys

import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState

from tests.ranks.hf_models import Model, accelerate, params, train

backend, out = sys.argv[1], sys.argv[2]

if backend == "mcrdl":  # what does not work: naming the backend to accelerate
    try:
        PartialState(cpu=True, backend="mcrdl")
        raise AssertionError("accelerate took backend='mcrdl' on CPU")
    except ValueError as exc:
        assert "backend mcrdl is not available" in str(exc), exc
    AcceleratorState._reset_state(reset_partial_state=True)

dist.init_process_group(backend)  # the workaround: the group first

accelerator = Accelerator(cpu=True)  # cpu=True: without it a CPU machine trains undistributed
assert accelerator.num_processes == 2
report = {"backend": dist.get_backend(), "accelerate": accelerate(accelerator)}
del accelerator

model = Model()
args, trainer = train(model, use_cpu=True)
assert args.world_size == 2 and dist.get_backend() == backend
report["trainer"] = params(model)
del trainer
# torch's gloo can hang at exit joining its threads from DDP's destructor: free first.
gc.collect()
dist.barrier()
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(report, f)
dist.destroy_process_group()
