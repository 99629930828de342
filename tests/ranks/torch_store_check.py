"""Started the way torch's test harness starts ranks: plain processes sharing a FileStore, no
launcher. ``dist.init_process_group("mcrdl", store=...)`` brings mcrdl up from that store
(gloo only), and a collective and a DDP step run through it.

    python tests/ranks/torch_store_check.py <store file> <rank> <world size>
"""

import sys

import torch
import torch.distributed as dist

import mcrdl
import mcrdl.torch

path, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("mcrdl", store=dist.FileStore(path, size), rank=rank, world_size=size)
assert mcrdl.torch.communicator().backends == ("gloo",)
assert "mpi4py.MPI" not in sys.modules
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [size * (size + 1) / 2] * 3, t
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
ddp(torch.full((2, 3), float(rank))).sum().backward()
mean_x = sum(range(size)) / size
assert torch.allclose(model.weight.grad, torch.full((1, 3), 2 * mean_x)), model.weight.grad
# A break on one member reaches the others through mcrdl's own store (a FileStore has no
# queues): rank 0 cancels an allreduce its peers have submitted, and theirs fails at once with
# CommBrokenError naming it, not after the timeout.
sub = mcrdl.torch.communicator().split(0)
if rank == 0:
    blocker = sub.recv(torch.zeros(1), src=1, tag=5)  # never sent: holds the allreduce back
    x = sub.allreduce(torch.ones(2), after=[blocker])
    assert x.cancel()
else:
    try:
        sub.allreduce(torch.ones(2)).wait(timeout=20)
    except mcrdl.CommBrokenError as exc:
        assert "cancel" in str(exc), exc
    else:
        raise AssertionError("the peer's cancellation did not reach this rank")
dist.destroy_process_group()
mcrdl.finalize()
print(f"file store rank={rank} size={size} ok", flush=True)
