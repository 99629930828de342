"""An expert-parallel mixture-of-experts block, trained with asyncio: the dispatch of one
micro-batch's tokens overlaps the expert compute of another.

    mpiexec -n 2 python examples/moe.py [--backend auto|mpi|gloo|mix] [--steps 300]
                                        [--plot moe.png] [--no-overlap]

The block: y = x + sum over the top-k experts e of gate_e(x) * expert_e(x), a softmax gate
(replicated on every rank, its gradient summed over the ranks) over ``EXPERTS_PER_RANK``
experts per rank (two-layer MLPs, each living on one rank). Each rank routes its own tokens:
top-``TOP_K`` experts per token, at most ``capacity()`` tokens per expert per micro-batch
(first choices first, then by token; the rest are dropped and keep only the residual).

One micro-batch, as an asyncio task (``micro_batch``):

1. route the tokens, then ``await comm.alltoall`` the number of tokens for each expert, and
   ``await comm.alltoallv`` the tokens to the ranks of their experts;
2. run the local experts on the tokens that arrived, and ``alltoallv`` the outputs back;
3. combine them with the gate's weights, compute the loss and its gradient;
4. ``alltoallv`` the outputs' gradients to the experts' ranks, and backpropagate through the
   experts there.

``MICRO`` micro-batches run as concurrent tasks: while one awaits its tokens, another routes
or computes. Their collectives are named (``name=``), so that the ranks match them although
each rank's tasks reach them in its own order. ``--no-overlap`` runs them one after another.
The parameters after N steps equal those of one process running every rank's micro-batches
with all the experts (``reference``; tests/multirank/test_examples.py checks it).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report  # noqa: E402
from _report import Run, backend_for  # noqa: E402

import mcrdl  # noqa: E402

D, H = 64, 128  # model width, expert hidden width
EXPERTS_PER_RANK = 2
TOP_K = 2
TOKENS = 64  # per micro-batch per rank
MICRO = 2  # micro-batches per step
CAPACITY = 1.25  # capacity factor
LR = 0.5


def capacity(experts: int) -> int:
    """Tokens an expert takes from one rank's micro-batch."""
    return math.ceil(CAPACITY * TOKENS * TOP_K / experts)


def make_params(size: int) -> dict[str, torch.Tensor]:
    """Every expert's weights and the gate's, the same on every rank (and in the reference)."""
    torch.manual_seed(0)
    experts = size * EXPERTS_PER_RANK
    return {"gate": (torch.randn(D, experts) * 0.1).requires_grad_(),
            "w1": (torch.randn(experts, D, H) / D ** 0.5).requires_grad_(),
            "w2": (torch.randn(experts, H, D) / H ** 0.5 * 0.5).requires_grad_()}


def data(step: int, rank: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``m`` of rank ``rank`` at ``step``: tokens and their target."""
    g = torch.Generator().manual_seed((step * 1009 + rank) * 31 + m)
    x = torch.randn(TOKENS, D, generator=g)
    a = torch.randn(D, D, generator=torch.Generator().manual_seed(5)) / D ** 0.5
    return x, torch.tanh(x @ a)


@dataclass
class Routing:
    """The kept (token, expert) assignments of one micro-batch, sorted by expert."""

    token: torch.Tensor  # row of x, per assignment
    expert: torch.Tensor  # global expert index, per assignment
    weight: torch.Tensor  # the gate's probability, per assignment (carries the gradient)
    per_expert: torch.Tensor  # assignments kept per expert (int64, one per expert)


def route(x: torch.Tensor, gate: torch.Tensor) -> Routing:
    """Top-k routing with a capacity: first choices first, then by token."""
    experts = gate.shape[1]
    probs = torch.softmax(x @ gate, dim=1)
    top_p, top_e = probs.topk(TOP_K, dim=1)
    expert = top_e.t().reshape(-1)  # choice-major: every token's first choice, then second
    token = torch.arange(x.shape[0]).repeat(TOP_K)
    weight = top_p.t().reshape(-1)
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(len(order)) - starts[expert[order]]  # position within its expert
    kept = order[place < capacity(experts)]
    return Routing(token[kept], expert[kept], weight[kept],
                   torch.bincount(expert[kept], minlength=experts))


def experts_on(rows: torch.Tensor, which: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
               ) -> torch.Tensor:
    """Each row through its expert (``which``: index into ``w1``/``w2``), in place of it."""
    out = torch.zeros_like(rows)
    for e in range(w1.shape[0]):
        idx = (which == e).nonzero().squeeze(1)
        if len(idx):
            out = out.index_copy(0, idx, torch.relu(rows[idx] @ w1[e]) @ w2[e])
    return out


def combine(x: torch.Tensor, r: Routing, outputs: torch.Tensor) -> torch.Tensor:
    """The block's output: the residual plus each kept assignment's weighted expert output."""
    return x.index_add(0, r.token, outputs * r.weight[:, None])


def loss_of(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over one micro-batch."""
    return ((y - target) ** 2).mean()


class Clock:
    """Seconds spent computing (not waiting for communication) in a step; each stretch is
    also a ``compute`` span on the timeline (``MCRDL_TRACE``)."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._t0 = 0.0
        self._span: Any = None

    def __enter__(self) -> Clock:
        self._span = mcrdl.span("compute")
        self._span.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.busy += time.perf_counter() - self._t0
        self._span.__exit__(None, None, None)


async def micro_batch(comm: mcrdl.Communicator, p: dict[str, torch.Tensor], step: int, m: int,
                      a2a: str, clock: Clock) -> float:
    """Forward and backward of micro-batch ``m``; returns its loss."""
    tag = f"moe/{step}/{m}"
    with clock:
        x, target = data(step, comm.rank, m)
        r = route(x, p["gate"])
        counts = r.per_expert.view(comm.size, EXPERTS_PER_RANK)
        send = x[r.token]
    arrived = await comm.alltoall(counts, backend=a2a, name=f"{tag}/counts")
    send_counts, recv_counts = counts.sum(1).tolist(), arrived.sum(1).tolist()
    rows = await comm.alltoallv(send, send_counts, recv_counts, backend=a2a,
                                name=f"{tag}/tokens")
    with clock:
        which = torch.repeat_interleave(torch.arange(EXPERTS_PER_RANK).repeat(comm.size),
                                        arrived.reshape(-1))  # local expert of each row
        out = experts_on(rows, which, p["w1"], p["w2"])
    back = await comm.alltoallv(out.detach(), recv_counts, send_counts, backend=a2a,
                                name=f"{tag}/outputs")
    with clock:
        back.requires_grad_()
        loss = loss_of(combine(x, r, back), target)
        (loss / (comm.size * MICRO)).backward()  # the gradient of the global mean
    grad = await comm.alltoallv(back.grad, send_counts, recv_counts, backend=a2a,
                                name=f"{tag}/grads")
    with clock:
        out.backward(grad)
    return loss.item()


async def train_async(comm: mcrdl.Communicator, backend: str, steps: int, overlap: bool
                      ) -> tuple[dict[str, torch.Tensor], Run]:
    full = make_params(comm.size)
    mine = slice(comm.rank * EXPERTS_PER_RANK, (comm.rank + 1) * EXPERTS_PER_RANK)
    p = {"gate": full["gate"],
         "w1": full["w1"][mine].detach().clone().requires_grad_(),
         "w2": full["w2"][mine].detach().clone().requires_grad_()}
    a2a, ar = backend_for(comm, backend, "alltoallv"), backend_for(comm, backend, "allreduce")
    run = Run(comm, waiting="not computing (waiting for communication, submitting)")
    for step in range(steps):
        clock = Clock()
        t0 = time.perf_counter()
        if overlap:
            losses = await asyncio.gather(
                *(micro_batch(comm, p, step, m, a2a, clock) for m in range(MICRO)))
        else:
            losses = [await micro_batch(comm, p, step, m, a2a, clock) for m in range(MICRO)]
        await comm.allreduce(p["gate"].grad, backend=ar)  # the replicated gate: sum
        with clock, torch.no_grad():
            for t in p.values():
                t -= LR * t.grad
                t.grad = None
        elapsed = time.perf_counter() - t0
        run.record(sum(losses) / MICRO, elapsed, elapsed - clock.busy)
    run.close()
    return p, run


def train(comm: mcrdl.Communicator, backend: str, steps: int, overlap: bool = True
          ) -> tuple[dict[str, torch.Tensor], Run]:
    """Train ``steps`` steps; this rank's parameters (the gate and its experts) and the
    run's records."""
    return asyncio.run(train_async(comm, backend, steps, overlap))


def reference(steps: int, size: int) -> dict[str, torch.Tensor]:
    """One process, every expert, every rank's micro-batches: what the ranks must compute."""
    p = make_params(size)
    for step in range(steps):
        for rank in range(size):
            for m in range(MICRO):
                x, target = data(step, rank, m)
                r = route(x, p["gate"])
                out = experts_on(x[r.token], r.expert, p["w1"], p["w2"])
                (loss_of(combine(x, r, out), target) / (size * MICRO)).backward()
        with torch.no_grad():
            for t in p.values():
                t -= LR * t.grad
                t.grad = None
    return p


def main() -> None:
    _report.main(__doc__, train, lambda comm: (
        f"MoE, {comm.size} ranks x {EXPERTS_PER_RANK} experts, top-{TOP_K}, {MICRO} "
        f"micro-batches of {TOKENS} tokens"))


if __name__ == "__main__":
    main()
