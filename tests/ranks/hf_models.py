"""The small dataset and model that accelerate and the transformers Trainer train in
``tests/ranks/hf_check.py`` (CPU) and ``tests/gpu/hf_cuda.py`` (CUDA)."""

import tempfile
from typing import Any

import torch
from torch.utils.data import Dataset


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


def accelerate(accelerator: Any) -> list[list[float]]:
    """An epoch of plain SGD over ``Data`` in batches of 8 through ``accelerator``; the
    parameters it ends with (accelerate's state is reset after)."""
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp, opt, loader = accelerator.prepare(model, opt, DataLoader(Data(), batch_size=8))
    for batch in loader:
        accelerator.backward(ddp(**batch)["loss"])
        opt.step()
        opt.zero_grad()
    del ddp, opt, loader
    AcceleratorState._reset_state(reset_partial_state=True)
    return params(model)


def train(model: torch.nn.Module, **how: Any) -> tuple[Any, Any]:
    """A transformers Trainer's epoch of plain SGD over ``Data`` in order (``how``: where it
    runs); its arguments and the trainer."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim="sgd", learning_rate=0.1,
                             lr_scheduler_type="constant", num_train_epochs=1,
                             per_device_train_batch_size=8, max_grad_norm=0.0, seed=0,
                             train_sampling_strategy="sequential", report_to="none",
                             save_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False, **how)
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    trainer.train()
    return args, trainer
