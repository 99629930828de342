"""Across emulated hosts (tests/test_cluster.py): which address each rank bound, and the bytes
each backend put on this host's link.

Prints ``host rank=R address=A local_size=L``, then per backend ``link rank=R backend=B
sent=<bytes> payload=<bytes>``: the growth of this namespace's interface counter across one
4 MiB allreduce, which is zero if the backend took a shortcut (shared memory, loopback)
instead of the link.
"""

import torch

import mcrdl

PAYLOAD = 4 << 20


def sent() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


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
    print(f"link rank={comm.rank} backend={backend} sent={after - before} payload={PAYLOAD}",
          flush=True)
mcrdl.finalize()
