"""torch's own distributed tests that are gated on the backend's name being "gloo" (or
"nccl"/"ucc"/"gloo"), run against "mcrdl": the module is imported as if the backend were
gloo, so that those tests are defined, and then runs every test on "mcrdl". Tests whose bodies
branch on the name take the path of a backend that is not gloo.

All marked ``torch_suite`` (``python -m pytest -m "" tests/torch_suite``).
"""

from __future__ import annotations

import os

import pytest

os.environ["BACKEND"] = "gloo"  # for the decorators, evaluated at import
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("MCRDL_TIMEOUT", "60")

pytest.importorskip("expecttest")

from torch.testing._internal.distributed import distributed_test  # noqa: E402

import mcrdl.torch  # noqa: E402,F401  (registers "mcrdl" here and in every spawned child)

distributed_test.BACKEND = "mcrdl"  # what init_process_group and the test bodies read
os.environ["BACKEND"] = "mcrdl"

pytestmark = pytest.mark.torch_suite


class TestMcrdlAsGloo(distributed_test.TestDistBackend,
                      distributed_test.DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
