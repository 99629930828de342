"""torch.distributed over "mcrdl" on CUDA tensors, one GPU per machine: run by
``tests/gpu/test_torch_cuda.py`` under torchrun, a world of one (NCCL and mcrdl's nccl lane)
and two ranks sharing the GPU (gloo staged through pinned host memory: NCCL refuses two ranks
on one GPU).

Started the torch way, without ``import mcrdl.torch`` (torch's backend entry point, or what
it calls, registers "mcrdl"), with ``device_id`` as DeepSpeed passes it on CUDA. Checks, each printing one line:

- every collective on CUDA tensors, each behind a kernel that keeps the caller's stream busy:
  it must read what that stream wrote, and its result must be ordered on the stream;
- ``Work.wait()`` does not block the host where the operation runs on a stream (a world of
  one: the nccl lane), and ``get_future()`` completes with the result, also through ``then``;
- an object collective (CPU) beside CUDA collectives in one group;
- DDP and FSDP2 on CUDA train as one process on the whole batch does; in a world of one,
  DDP over "mcrdl" ends bit for bit where it ends over "nccl";
- mcrdl's own ``comm.alltoall`` on CUDA beside DDP's allreduces.

Prints ``torch cuda ok: N ranks, ...`` on rank 0 at the end.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

#: Cycles of torch.cuda._sleep that outlast any race (~1 ms on an H200).
SLOW = 2_000_000


def _busy() -> None:
    """Keep the caller's current stream busy: what follows must wait for it."""
    torch.cuda._sleep(SLOW)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).cuda()


def _batches(n: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * n, 6, generator=g).cuda(), torch.randn(4 * n, 3, generator=g).cuda())
            for _ in range(steps)]


def _train(model: torch.nn.Module, n: int, rows: slice, steps: int, alongside=None
           ) -> list[torch.Tensor]:
    """SGD on ``rows`` of each of ``steps`` batches (of ``4 * n`` rows); ``alongside()``, if
    given, starts something before each step and returns a check to run after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(n, steps):
        check = alongside() if alongside is not None else None
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        if check is not None:
            check()
    return [p.detach().clone() for p in model.parameters()]


def _mine(r: int) -> slice:
    return slice(4 * r, 4 * (r + 1))


def _whole(n: int, steps: int) -> list[torch.Tensor]:
    """The same training on the whole batch, in one process: what DDP and FSDP2 must give."""
    return _train(_model(), n, slice(None), steps)


def collectives(r: int, n: int) -> None:
    cuda = torch.device("cuda")

    def filled(shape, value, dtype=torch.float32):
        t = torch.zeros(shape, dtype=dtype, device=cuda)
        _busy()
        t.fill_(value)  # queued behind the busy kernel: the collective must read this
        return t

    t = filled(4, r + 1.0)
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 4, t
    t = filled(3, r + 1, torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # integer AVG truncates, as NCCL's
    assert t.tolist() == [(n * (n + 1) // 2) // n] * 3, t
    t = filled(5, float(r))
    dist.broadcast(t, src=n - 1)
    assert t.tolist() == [n - 1.0] * 5
    outs = [torch.zeros(2, device=cuda) for _ in range(n)]
    dist.all_gather(outs, filled(2, r + 10.0))
    assert [o.tolist() for o in outs] == [[i + 10.0] * 2 for i in range(n)]
    big = torch.zeros(2 * n, device=cuda)
    dist.all_gather_into_tensor(big, filled(2, float(r)))
    assert big.tolist() == [float(i) for i in range(n) for _ in range(2)]
    rs = torch.zeros(2, device=cuda)
    dist.reduce_scatter_tensor(rs, filled(2 * n, 1.0))
    assert rs.tolist() == [float(n)] * 2
    a2a = torch.zeros(n, device=cuda)
    dist.all_to_all_single(a2a, filled(n, float(r)) + torch.arange(n, device=cuda) * 100)
    assert a2a.tolist() == [100.0 * r + i for i in range(n)], a2a
    lists = [torch.zeros(1, device=cuda) for _ in range(n)]
    dist.all_to_all(lists, [filled(1, float(r * n + i)) for i in range(n)])
    assert [x.item() for x in lists] == [float(i * n + r) for i in range(n)]
    gathered = [torch.zeros(1, device=cuda) for _ in range(n)] if r == 0 else None
    dist.gather(filled(1, float(r)), gathered, dst=0)
    if r == 0:
        assert [x.item() for x in gathered] == [float(i) for i in range(n)]
    got = torch.zeros(1, device=cuda)
    dist.scatter(got, [filled(1, float(i)) for i in range(n)] if r == 0 else None, src=0)
    assert got.item() == float(r)
    if n > 1:
        if r == 0:
            dist.send(filled(3, 7.0), 1)
        elif r == 1:
            got = torch.zeros(3, device=cuda)
            dist.recv(got, 0)
            assert got.tolist() == [7.0] * 3
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})  # on CPU, in the same group
    assert objs == [{"rank": i} for i in range(n)]
    dist.barrier()
    print(f"rank {r}: collectives on CUDA ordered after the caller's stream: ok", flush=True)


def works(r: int, n: int) -> None:
    t = torch.full((1 << 10,), float(r + 1), device="cuda")
    torch.cuda.synchronize()
    _busy()
    t0 = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    busy = _sleep_seconds()
    assert t[0].item() == n * (n + 1) / 2
    if n == 1:  # the nccl lane: the host waits only until the operation is queued
        assert host < busy / 2, (host, busy)
    t = torch.full((8,), 1.0, device="cuda")
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    assert doubled.wait().tolist() == [2.0 * n] * 8
    assert fut.wait()[0].tolist() == [float(n)] * 8
    print(f"rank {r}: Work.wait() host {host * 1e6:.0f} µs against a {busy * 1e6:.0f} µs "
          f"kernel; get_future and then: ok", flush=True)


def _sleep_seconds() -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _busy()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def ddp(r: int, n: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mcrdl.torch

    comm = mcrdl.torch.communicator()
    alltoalls = []

    def alongside():
        moved = comm.alltoall(torch.arange(3.0 * n, device="cuda") + 100 * r)
        alltoalls.append(moved)

        def check():
            want = [100.0 * s + 3 * r + k for s in range(n) for k in range(3)]
            assert moved.wait().tolist() == want
        return check

    got = _train(DDP(_model(), bucket_cap_mb=0.0005), n, _mine(r), 3, alongside)
    for a, b in zip(got, _whole(n, 3)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if n == 1:
        nccl = dist.new_group(backend="nccl")
        over_nccl = _train(DDP(_model(), process_group=nccl, bucket_cap_mb=0.0005), n,
                           _mine(r), 3)
        assert all(torch.equal(a, b) for a, b in zip(got, over_nccl))
    print(f"rank {r}: DDP on CUDA (with comm.alltoall on "
          f"{alltoalls[0].lane.backend_name}) as one process: ok", flush=True)


def fsdp2(r: int, n: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (n,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, n, _mine(r), 3)
    got = [p.full_tensor().detach() for p in model.parameters()]
    for a, b in zip(got, _whole(n, 3)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print(f"rank {r}: FSDP2 on CUDA as one process: ok", flush=True)


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(0)  # one GPU: every rank shares it
    if "mcrdl" not in dist.Backend.backend_list:  # run from a source tree: no entry point
        import _mcrdl_torch

        _mcrdl_torch.register()
    assert "mcrdl.torch" not in sys.modules
    dist.init_process_group("mcrdl", device_id=torch.device("cuda", 0))
    r, n = dist.get_rank(), dist.get_world_size()
    assert (r, dist.get_backend()) == (local, "mcrdl")
    collectives(r, n)
    works(r, n)
    ddp(r, n)
    fsdp2(r, n)
    dist.barrier()
    if r == 0:
        print(f"torch cuda ok: {n} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
