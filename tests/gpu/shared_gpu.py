"""Ranks sharing one GPU over the staged host backends: every rank's CUDA tensors go through
pinned host copies to gloo (and MPI, under mpiexec), and come back in device memory.

Run by ``tests/gpu/test_gpu.py``: 2 ranks under torchrun and, where there is an mpiexec, 2
and 4 under it. NCCL refuses two ranks on one GPU; staging does not care.
"""

from __future__ import annotations

import sys

import torch

import mcrdl


def main() -> None:
    torch.cuda.set_device(0)
    backends = sys.argv[1].split(",")
    comm = mcrdl.init(backends=backends)
    rank, n = comm.rank, comm.size
    for name in backends:
        staged = comm.runtime.backend(name).capabilities.staged
        assert staged == frozenset({"cuda"}), (name, staged)
        x = torch.full((1 << 16,), float(rank + 1), device="cuda")
        torch.cuda._sleep(1_000_000)  # the caller's stream busy: the copy must wait for it
        x.mul_(2.0)
        assert torch.equal(comm.allreduce(x, backend=name).wait(),
                           torch.full_like(x, float(n * (n + 1))))
        y = torch.arange(4 * n, dtype=torch.float32, device="cuda") + 100 * rank
        out = comm.alltoall(y, backend=name).wait()
        want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 100 * r
                          for r in range(n)]).cuda()
        assert out.device.type == "cuda" and torch.equal(out, want), (out, want)
        g = comm.allgather(torch.tensor([rank], device="cuda"), backend=name).wait()
        assert g.tolist() == list(range(n))
        b = torch.full((8,), float(rank), device="cuda")
        assert comm.broadcast(b, 1, backend=name).wait().tolist() == [1.0] * 8
        if rank == 0:
            comm.send(torch.full((3,), 7.0, device="cuda"), 1, backend=name).wait()
        elif rank == 1:
            got = torch.zeros(3, device="cuda")
            comm.recv(got, 0, backend=name).wait()
            assert got.tolist() == [7.0] * 3
    comm.barrier().wait()
    if rank == 0:
        print(f"shared GPU ok: {n} ranks, {', '.join(backends)} staged")
    mcrdl.finalize()


if __name__ == "__main__":
    main()
