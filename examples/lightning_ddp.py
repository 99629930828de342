"""Train with PyTorch Lightning's DDP strategy over the "mcrdl" backend.

    mpiexec -n 2 python examples/lightning_ddp.py             # processes made by MPI
    python examples/lightning_ddp.py --devices 2               # made by Lightning's launcher
    ... --backend gloo                                         # the same over torch's gloo

The Lightning code is unchanged but for ``DDPStrategy(process_group_backend="mcrdl")``: the
name reaches torch through mcrdl's ``torch.backends`` entry point, with no ``import mcrdl``.
Under ``mpiexec`` Lightning finds its MPI environment and mcrdl comes up with MPI and gloo;
under Lightning's own launcher it comes up from torch's store, on gloo. The step logs its loss
with ``sync_dist=True`` (an allreduce per value), early stopping decides on every rank at
once (another allreduce), and the best epoch's checkpoint is written. ``--out FILE``
writes what the run ended with (parameters, epochs, metrics) for comparing backends.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def validation_step(self, batch: list[torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(99))
    return TensorDataset(x, torch.tanh(x @ w) + 0.3 * torch.randn(n, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mcrdl", help="mcrdl (default) or gloo")
    parser.add_argument("--devices", type=int, default=2, help="processes on this host")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the run's end state here (JSON)")
    args = parser.parse_args()
    for noise in (".*does not have many workers.*", ".*LeafSpec.*"):  # Lightning's own
        warnings.filterwarnings("ignore", noise)
    seed_everything(0, verbose=False)
    ckpt_dir = os.environ.get("LIGHTNING_CKPT_DIR") or tempfile.mkdtemp(prefix="ckpt-")
    # The launcher's children inherit the directory through the environment.
    os.environ["LIGHTNING_CKPT_DIR"] = ckpt_dir

    # Stops when the validation loss has not improved by 1e-3 for two epochs.
    stopping = EarlyStopping("val_loss", min_delta=1e-3, patience=2)
    best = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss")
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                      strategy=DDPStrategy(process_group_backend=args.backend),
                      callbacks=[stopping, best], logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    model = Regression()
    trainer.fit(model, DataLoader(data(256, 1), batch_size=16),
                DataLoader(data(64, 2), batch_size=16))

    report = {
        "backend": dist.get_backend(),
        "world_size": trainer.world_size,
        "epochs": trainer.current_epoch,
        "stopped_epoch": stopping.stopped_epoch,
        "metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "checkpoint": os.path.basename(best.best_model_path),
    }
    # Leave together, the group torn down first: torch's gloo can abort a process that
    # exits while its peer's connections close.
    dist.barrier()
    dist.destroy_process_group()
    if trainer.global_rank == 0:
        saved = torch.load(best.best_model_path, weights_only=False)["state_dict"]
        report["checkpoint_params"] = [v.flatten().tolist() for v in saved.values()]
        print(f"{report['backend']}: {report['world_size']} ranks, stopped at epoch "
              f"{report['epochs']}, val_loss {report['metrics']['val_loss']:.6f}, "
              f"best checkpoint {report['checkpoint']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)


if __name__ == "__main__":
    main()
