"""A pipeline step with an expert layer, checked in the simulated world before it runs.

Run it for real on 2 or 4 ranks, or check it (and its three bugs) in one process:

    mpiexec -n 4 python examples/pipeline_step.py
    python examples/pipeline_step.py --check               # the step, then each bug

or record what each rank did in a real run (saved even when the step fails), and replay the
recordings in the simulated world under many timings:

    mpiexec -n 4 python examples/pipeline_step.py --record step-{rank}.json [--bug skip]
    python examples/pipeline_step.py --replay step-*.json

The ranks form two pipeline stages of ``size / 2`` data-parallel replicas each: stage 0 is
ranks ``0 .. size/2-1``, stage 1 the rest, and replica ``r`` of stage 0 feeds replica ``r``
of stage 1. A step runs ``MICRO`` micro-batches, each an asyncio task:

- stage 0 sends the micro-batches' activations to its peer in stage 1, and receives their
  gradients back;
- stage 1 receives the activations, routes their tokens to the stage's experts (a named
  alltoallv on gloo among the stage's replicas: the expert layer), and sends gradients back,
  in micro-batch order;
- every rank then allreduces the micro-batch's loss over the world, named by micro-batch.

Then each stage allreduces its gradients over its replicas on MPI, and the world allreduces
the step's loss. Micro-batch ``m`` has ``m + 2`` tokens, so each micro-batch's operations
have shapes of their own.

The three bugs (``--bug``): ``recv-first``, stage 0 waits for the first gradients before it
sends the activations (both stages then wait to receive: a deadlock); ``skip``, stage 1 skips the
step's world allreduce; ``unnamed``, the micro-batches' collectives lose their ``name=``
(tasks then submit them in an order that timing decides, which differs between ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

import mcrdl
from mcrdl.testing import Recording, StepFailed, check_step, record, replay_ranks

MICRO = 3
BUGS = ("recv-first", "skip", "unnamed")


async def step(comm: mcrdl.Communicator, bug: str | None = None) -> list[float]:
    """One training step of this rank: the loss of each micro-batch, then the step's."""
    half = comm.size // 2
    stage, replica = divmod(comm.rank, half)
    peer = replica + half if stage == 0 else replica
    replicas = comm.split(stage)  # the stage's data-parallel replicas (never None: a color)
    assert replicas is not None

    def named(label: str) -> str | None:
        return None if bug == "unnamed" else label

    acts = [np.full(m + 2, float(comm.rank + m)) for m in range(MICRO)]
    grads = [np.empty(m + 2) for m in range(MICRO)]
    if stage == 0:
        # Sends and receives are posted in micro-batch order, all sends first (a stream of
        # NCCL runs them in the order posted: the two stages must post in matching orders).
        if bug == "recv-first":
            recvs = [comm.recv(grads[m], peer, tag=100 + m) for m in range(MICRO)]
            await recvs[0]
            sends = [comm.send(acts[m], peer, tag=m) for m in range(MICRO)]
        else:
            sends = [comm.send(acts[m], peer, tag=m) for m in range(MICRO)]
            recvs = [comm.recv(grads[m], peer, tag=100 + m) for m in range(MICRO)]
        await asyncio.gather(*sends)
    else:
        recvs = [comm.recv(acts[m], peer, tag=m) for m in range(MICRO)]
    sent = [asyncio.Event() for _ in range(MICRO)]

    async def micro(m: int) -> float:
        tokens = m + 2
        await recvs[m]
        if stage == 1:
            # The expert layer: each replica sends its tokens round-robin to the stage's
            # experts, one expert a replica (a named alltoallv: the micro-batches' tasks
            # reach it in an order that timing decides).
            counts = [tokens // half + (e < tokens % half) for e in range(half)]
            routed = np.empty(counts[replica] * half)
            await replicas.alltoallv(acts[m], counts, out=routed,
                                     recv_counts=[counts[replica]] * half, backend="gloo",
                                     name=named(f"moe/{m}"))
            grads[m][:] = acts[m] * 2.0
            if m:  # the gradients go back in micro-batch order too
                await sent[m - 1].wait()
            send = comm.send(grads[m], peer, tag=100 + m)
            sent[m].set()
            await send
        loss = np.full(tokens, float(grads[m].sum()) if stage == 0 else 0.0)
        await comm.allreduce(loss, name=named(f"loss/{m}"))
        return float(loss[0])

    losses = await asyncio.gather(*(micro(m) for m in range(MICRO)))
    weights = np.full(4, float(comm.rank))
    await replicas.allreduce(weights, backend="mpi")
    total = np.array([sum(losses)])
    if not (bug == "skip" and stage == 1):
        await comm.allreduce(total)
    return [*losses, float(total[0])]


def reference(size: int) -> list[list[float]]:
    """What every rank's step returns, computed without communication."""
    half = size // 2
    losses = []
    for m in range(MICRO):
        tokens = m + 2
        # stage 0 rank r sent r + m, and got 2 (r + m) back per token
        losses.append(float(sum(2.0 * (r + m) * tokens for r in range(half))))
    total = float(sum(losses)) * size
    return [[*losses, total] for _ in range(size)]


def check_results(results: list[list[float]], size: int) -> None:
    want = reference(size)
    if results != want:
        raise AssertionError(f"results {results}, expected {want}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="check the step and each bug in the simulated world")
    parser.add_argument("--bug", choices=BUGS, help="run this bug for real")
    parser.add_argument("--record", metavar="PATH",
                        help="record each rank's operations to PATH ({rank}: the rank)")
    parser.add_argument("--replay", nargs="+", metavar="FILE",
                        help="replay every rank's recording in the simulated world")
    args = parser.parse_args()
    if args.replay:
        try:
            replay_ranks([Recording.load(path) for path in args.replay], seeds=range(20))
        except StepFailed as failed:
            sys.exit(f"the recorded step failed in the simulated world:\n{failed}")
        print("the recorded step passes: 'mpi' and 'nccl' semantics, 20 seeds each")
        return
    if args.check:
        check_step(step, seeds=range(8), check=check_results)
        print("the step passes: 2 and 4 ranks, 'mpi' and 'nccl' semantics, 8 seeds each")
        for bug in BUGS:
            try:
                check_step(lambda comm, bug=bug: step(comm, bug), seeds=range(8),
                           check=check_results)
            except StepFailed as failed:
                print(f"--bug {bug}: {type(failed.error).__name__} on {failed.size} ranks, "
                      f"{failed.semantics!r} semantics, seed {failed.seed}")
            else:
                sys.exit(f"--bug {bug} was not found")
        return
    with mcrdl.init() as comm:
        if comm.size % 2:
            sys.exit("run on an even number of ranks")
        if args.record:
            with record(comm, args.record):
                got = asyncio.run(step(comm, args.bug))
        else:
            got = asyncio.run(step(comm, args.bug))
        want = reference(comm.size)[comm.rank]
        print(f"rank {comm.rank}: losses {got} ({'right' if got == want else 'WRONG'})")


if __name__ == "__main__":
    main()
