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
import tempfile

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, Dataset
from transformers import Trainer, TrainingArguments

backend, out = sys.argv[1], sys.argv[2]


class Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def params(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


if backend == "mcrdl":  # what does not work: naming the backend to accelerate
    try:
        PartialState(cpu=True, backend="mcrdl")
        raise AssertionError("accelerate took backend='mcrdl' on CPU")
    except ValueError as exc:
        assert "backend mcrdl is not available" in str(exc), exc
    AcceleratorState._reset_state(reset_partial_state=True)

dist.init_process_group(backend)  # the workaround: the group first

accelerator = Accelerator(cpu=True)  # cpu=True: without it a CPU machine trains undistributed
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ddp, opt, loader = accelerator.prepare(model, opt, DataLoader(Data(), batch_size=8))
assert accelerator.num_processes == 2
for batch in loader:
    accelerator.backward(ddp(**batch)["loss"])
    opt.step()
    opt.zero_grad()
report = {"backend": dist.get_backend(), "accelerate": params(model)}
del ddp, opt, loader, accelerator
AcceleratorState._reset_state(reset_partial_state=True)

model = Model()
args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, optim="sgd",
                         learning_rate=0.1, lr_scheduler_type="constant", num_train_epochs=1,
                         per_device_train_batch_size=8, max_grad_norm=0.0, seed=0,
                         train_sampling_strategy="sequential", report_to="none",
                         save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
trainer = Trainer(model=model, args=args, train_dataset=Data())
trainer.train()
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
