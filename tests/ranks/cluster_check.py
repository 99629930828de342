"""Across emulated hosts (tests/test_cluster.py): which address each rank bound, and the bytes
each backend put on this host's link.

Prints ``host rank=R address=A local_size=L``, then per backend and link ``link rank=R
backend=B dev=D sent=<bytes> payload=<bytes>``: the growth of this namespace's interface
counters across one 4 MiB allreduce, which is zero on every link if the backend took a
shortcut (shared memory, loopback) instead.
"""

import os

import torch

import mcrdl

PAYLOAD = 4 << 20
DEVICES = sorted(d for d in os.listdir("/sys/class/net") if d != "lo")


def sent() -> dict[str, int]:
    counts = {}
    for dev in DEVICES:
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
            counts[dev] = int(f.read())
    return counts


comm = mcrdl.init()
boot = comm.runtime.bootstrap
print(f"host rank={comm.rank} address={boot.host} local_size={boot.local_size}", flush=True)
for backend in ("mpi", "gloo"):
    x = torch.full((PAYLOAD // 4,), float(comm.rank + 1))
    comm.barrier(backend="mpi").wait()
    before = sent()
    comm.allreduce(x, backend=backend).wait()
    after = sent()
    assert torch.all(x == comm.size * (comm.size + 1) / 2), (backend, x[:4])
    for dev in DEVICES:
        print(f"link rank={comm.rank} backend={backend} dev={dev} "
              f"sent={after[dev] - before[dev]} payload={PAYLOAD}", flush=True)
mcrdl.finalize()
