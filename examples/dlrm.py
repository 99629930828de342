"""A DLRM-style recommendation model: embedding tables sharded over the ranks (model
parallel), MLPs replicated (data parallel).

    mpiexec -n 2 python examples/dlrm.py [--backend auto|mpi|gloo|mix] [--steps 300]
                                         [--plot dlrm.png] [--no-overlap]

Each rank owns ``TABLES_PER_RANK`` embedding tables and trains on its slice of the global
batch. One step:

1. forward: every rank pools its own tables' rows for the whole global batch (a data loader
   that reads sparse features by table hands them over), and ``alltoall`` sends each rank
   the pooled embeddings of its samples; then the bottom MLP on the dense features, the
   pairwise dot products of all the vectors, the top MLP and the loss;
2. backward: as soon as the embeddings' gradient is computed (a tensor hook), its
   ``alltoall`` goes back to the tables' owners while backward goes on through the bottom
   MLP; the MLPs' gradients are averaged in buckets from backward hooks
   (``data_parallel.GradBuckets``);
3. the tables' owners backpropagate the gradients that came back through the pooling; the
   step waits for the MLP buckets and updates everything (SGD).

``--no-overlap`` sends the gradients after backward and waits for each operation at once.
The parameters after N steps equal those of one process holding every table and training on
the whole batch (``reference``; tests/multirank/test_examples.py checks it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report  # noqa: E402
from _report import Run, backend_for  # noqa: E402
from data_parallel import GradBuckets  # noqa: E402

import mcrdl  # noqa: E402

DENSE, D = 16, 32  # dense features, embedding width
TABLES_PER_RANK, ROWS, BAG = 2, 1000, 4  # tables per rank, rows per table, indices per bag
BATCH = 64  # samples per rank per step
LR = 0.5


class Model(torch.nn.Module):
    """Every table and both MLPs; a rank keeps only its own tables' weights trained."""

    def __init__(self, size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = size * TABLES_PER_RANK
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(ROWS, D, mode="sum") for _ in range(tables))
        for t in self.tables:
            torch.nn.init.normal_(t.weight, std=0.1)
        self.mlps = torch.nn.ModuleDict({
            "bottom": torch.nn.Sequential(torch.nn.Linear(DENSE, 64), torch.nn.ReLU(),
                                          torch.nn.Linear(64, D), torch.nn.ReLU()),
            "top": torch.nn.Sequential(torch.nn.Linear(D + (tables + 1) * tables // 2, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 1))})

    def pool(self, which: range, idx: torch.Tensor) -> torch.Tensor:
        """Tables ``which`` pooled over bags ``idx`` (samples x all tables x BAG):
        samples x len(which) x D."""
        return torch.stack([self.tables[t](idx[:, t]) for t in which], dim=1)

    def head(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The logits from the dense features and every table's pooled embedding."""
        bottom = self.mlps["bottom"](dense)
        z = torch.cat([bottom[:, None], emb], dim=1)  # samples x (tables + 1) x D
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        dots = (z @ z.transpose(1, 2))[:, i, j]
        return self.mlps["top"](torch.cat([bottom, dots], dim=1))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense features, bags of indices into every table, and click labels for all ranks."""
    g = torch.Generator().manual_seed(2000 + step)
    n, tables = size * BATCH, size * TABLES_PER_RANK
    dense = torch.randn(n, DENSE, generator=g)
    idx = torch.randint(0, ROWS, (n, tables, BAG), generator=g)
    truth = torch.Generator().manual_seed(11)
    w = torch.randn(DENSE, generator=truth)
    row_value = torch.randn(ROWS, generator=truth)
    score = dense @ w + row_value[idx].sum(dim=(1, 2)) / tables ** 0.5
    return dense, idx, (score > 0).float()[:, None]


def train(comm: mcrdl.Communicator, backend: str, steps: int, overlap: bool = True
          ) -> tuple[Model, Run]:
    """Train ``steps`` steps; the model (this rank's tables and the MLPs are trained) and the
    run's records."""
    model = Model(comm.size)
    mine = range(comm.rank * TABLES_PER_RANK, (comm.rank + 1) * TABLES_PER_RANK)
    a2a = backend_for(comm, backend, "alltoall")
    buckets = GradBuckets(comm, model.mlps, backend_for(comm, backend, "allreduce"), overlap)
    tables = [p for t in mine for p in model.tables[t].parameters()]
    opt = torch.optim.SGD([*model.mlps.parameters(), *tables], lr=LR)
    rows = slice(comm.rank * BATCH, (comm.rank + 1) * BATCH)
    run = Run(comm)
    for step in range(steps):
        dense, idx, label = global_batch(step, comm.size)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        pooled = model.pool(mine, idx)  # the global batch, my tables
        send = pooled.detach().reshape(comm.size * BATCH, -1)
        fut = comm.alltoall(send, backend=a2a)  # chunk j: rank j's samples
        t_wait = time.perf_counter()
        got = fut.wait()
        waited = time.perf_counter() - t_wait
        # from rank i: its tables for my samples -> samples x every table x D
        emb = got.view(comm.size, BATCH, TABLES_PER_RANK, D).transpose(0, 1).reshape(
            BATCH, -1, D).requires_grad_()
        back: list[mcrdl.CommFuture] = []

        def send_back(grad: torch.Tensor) -> None:
            # the owners' rows of my samples: the inverse of the permutation above
            g = grad.view(BATCH, comm.size, TABLES_PER_RANK * D).transpose(0, 1).contiguous()
            back.append(comm.alltoall(g.view(comm.size * BATCH, -1), backend=a2a))

        if overlap:
            emb.register_hook(send_back)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model.head(dense[rows], emb), label[rows])
        loss.backward()
        if not overlap:
            send_back(emb.grad)
        t_wait = time.perf_counter()
        grad = back[0].wait()
        waited += time.perf_counter() - t_wait
        # every rank's local mean: their sum is size times the global mean's gradient
        pooled.backward(grad.view_as(pooled) / comm.size)
        waited += buckets.wait()
        opt.step()
        run.record(loss.item(), time.perf_counter() - t0, waited)
    run.close()
    return model, run


def reference(steps: int, size: int) -> Model:
    """One process, every table, the whole global batch."""
    model = Model(size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        dense, idx, label = global_batch(step, size)
        opt.zero_grad()
        emb = model.pool(range(size * TABLES_PER_RANK), idx)
        torch.nn.functional.binary_cross_entropy_with_logits(
            model.head(dense, emb), label).backward()
        opt.step()
    return model


def main() -> None:
    _report.main(__doc__, train, lambda comm: (
        f"DLRM, {comm.size} ranks x {TABLES_PER_RANK} tables, batch {BATCH} per rank"))


if __name__ == "__main__":
    main()
