"""Under torchrun, torch.distributed's own way, without importing mcrdl: "mcrdl" is found
through torch's backend entry point (tests/test_multirank.py)."""

import sys

import torch
import torch.distributed as dist

assert "mcrdl" in dist.Backend.backend_list, dist.Backend.backend_list
assert "mcrdl" not in sys.modules  # import torch registered the name, and imported nothing
dist.init_process_group("mcrdl")
assert dist.get_backend() == "mcrdl", dist.get_backend()
x = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(x)
assert x.tolist() == [float(sum(range(1, dist.get_world_size() + 1)))] * 4, x
print(f"entry rank={dist.get_rank()} size={dist.get_world_size()} ok", flush=True)
dist.destroy_process_group()
