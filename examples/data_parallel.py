"""Data-parallel training two ways: gradient buckets allreduced from backward hooks with
mcrdl's own API, and DDP over the "mcrdl" torch.distributed backend.

    mpiexec -n 2 python examples/data_parallel.py [--way mcrdl|ddp] [--backend auto|mpi|gloo|mix]
                                                  [--steps 200] [--plot dp.png] [--no-overlap]

mcrdl's way (``GradBuckets``): the parameters are cut into buckets of about
``BUCKET_BYTES`` in the order backward produces their gradients. When the last gradient of
a bucket has been accumulated, a hook copies the bucket into one flat tensor and submits its
allreduce (AVG) without waiting, and backward goes on computing the next layers' gradients
while it runs; the step waits for every bucket just before the optimizer. ``--no-overlap``
submits the buckets after backward instead; ``--backend mix`` puts every other bucket on
gloo. DDP's way does the same inside torch, over the mcrdl process group.

Every rank takes its slice of one global batch, so the parameters after N steps equal those
of one process training on the whole batch (tests/multirank/test_examples.py checks it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Run, backend_for, parser, show  # noqa: E402

import mcrdl  # noqa: E402
import mcrdl.torch  # noqa: E402  (registers the backend "mcrdl" with torch.distributed)

IN, WIDTH, DEPTH = 64, 256, 4
BATCH = 32  # rows per rank per step
LR = 0.2
BUCKET_BYTES = 256 << 10


def make_model() -> torch.nn.Sequential:
    """The same initial parameters on every rank (and in the one-process reference)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, WIDTH), torch.nn.Tanh()]
    for _ in range(DEPTH - 2):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(WIDTH, 1))
    return torch.nn.Sequential(*layers)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch for all ``size`` ranks: inputs and a smooth target."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size * BATCH, IN, generator=g)
    w = torch.randn(IN, 1, generator=torch.Generator().manual_seed(7)) / IN ** 0.5
    return x, torch.sin(x @ w)


def local_batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, size)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[rows], y[rows]


class GradBuckets:
    """Gradients in buckets, each averaged over the ranks as soon as backward has produced
    all of it (or, without overlap, after backward)."""

    def __init__(self, comm: mcrdl.Communicator, model: torch.nn.Module, backend: str,
                 overlap: bool) -> None:
        self.comm = comm
        self.overlap = overlap
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(list(model.parameters())):  # backward's order, roughly
            if size >= BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        # --backend mix: every other bucket on the alltoall backend, to mix two in one step.
        kinds = ("alltoall", "allreduce") if backend == "mix" else ("allreduce",)
        self.backends = [backend_for(comm, backend, kinds[i % len(kinds)])
                         for i in range(len(self.buckets))]
        self.flat = [torch.empty(sum(p.numel() for p in b)) for b in self.buckets]
        self.where = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.left = [len(b) for b in self.buckets]
        self.futs: list[mcrdl.CommFuture | None] = [None] * len(self.buckets)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: torch.Tensor) -> None:
        i = self.where[p]
        self.left[i] -= 1
        if self.left[i] == 0 and self.overlap:
            self._submit(i)

    def _submit(self, i: int) -> None:
        torch.cat([p.grad.flatten() for p in self.buckets[i]], out=self.flat[i])
        self.futs[i] = self.comm.allreduce(self.flat[i], mcrdl.ReduceOp.AVG,
                                           backend=self.backends[i])

    def wait(self) -> float:
        """Finish every bucket's allreduce and put the averages back into ``.grad``;
        returns the seconds spent waiting."""
        for i, fut in enumerate(self.futs):
            if fut is None:
                self._submit(i)
        t0 = time.perf_counter()
        for fut in self.futs:
            fut.wait()  # type: ignore[union-attr]
        waited = time.perf_counter() - t0
        for bucket, flat in zip(self.buckets, self.flat):
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.left = [len(b) for b in self.buckets]
        self.futs = [None] * len(self.buckets)
        return waited


def train(comm: mcrdl.Communicator, way: str, backend: str, steps: int, overlap: bool = True
          ) -> tuple[torch.nn.Module, Run]:
    """Train ``steps`` steps; the trained model and the run's records."""
    model = make_model()
    run = Run(comm)
    if way == "ddp":
        if backend == "mix":
            raise SystemExit("--backend mix alternates mcrdl's own buckets; DDP's allreduces "
                             "all run on one backend: use auto, mpi or gloo with --way ddp")
        mcrdl.torch.set_backend(None, backend)
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=BUCKET_BYTES / 2**20)
        buckets = None
    else:
        net = model
        buckets = GradBuckets(comm, model, backend, overlap)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = local_batch(step, comm.rank, comm.size)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()  # DDP waits for its buckets at the end of backward
        waited = buckets.wait() if buckets is not None else float("nan")
        opt.step()
        run.record(loss.item(), time.perf_counter() - t0, waited)
    run.close()
    return model, run


def reference(steps: int, size: int) -> torch.nn.Module:
    """One process training on the whole global batch: what every rank's model must equal."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = global_batch(step, size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=200)
    p.add_argument("--way", choices=["mcrdl", "ddp"], default="mcrdl")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.way == "ddp":
        mcrdl.torch.init_process_group()
        comm = mcrdl.torch.communicator()
    else:
        comm = mcrdl.init()
    _, run = train(comm, args.way, args.backend, args.steps, args.overlap)
    show(comm, run, args, f"data parallel ({args.way}), {comm.size} ranks")
    if args.way == "ddp":
        torch.distributed.destroy_process_group()
    mcrdl.finalize()


if __name__ == "__main__":
    main()
