"""torch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in the torch
wheel) against the "mcrdl" backend, at 2 ranks, started the way torch starts it: spawned
processes and a FileStore, so mcrdl comes up from torch's store (gloo only).

The default run keeps the tests named in ``DEFAULT`` (a process launch each, ~5 s here); the
others are marked ``torch_suite`` (``python -m pytest -m "" tests/torch_suite`` runs them
all). What fails for mcrdl, and why, is in docs/torch.md ("torch's own distributed tests").
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("BACKEND", "mcrdl")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("MCRDL_TIMEOUT", "60")

pytest.importorskip("expecttest")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import mcrdl.torch  # noqa: E402,F401  (registers "mcrdl" here and in every spawned child)

for feature in ("ddp", "subgroup", "plugin"):
    DistTestCases.backend_feature[feature].add("mcrdl")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

#: Kept in the default run: collectives of each kind, send/recv with tags, DDP on CPU.
DEFAULT = frozenset({
    "test_all_reduce_sum", "test_all_gather", "test_all_gather_coalesced_simple",
    "test_reduce_sum", "test_scatter", "test_send_recv_with_tag",
    "test_DistributedDataParallelCPU", "test_static_graph_api_cpu",
})


class TestMcrdl(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
