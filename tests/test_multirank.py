"""The multi-rank suites, each run in one launch per world size (2 and 4 ranks)."""

from __future__ import annotations

import pytest

from tests.launch import run_suite

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("n", [2, 4])
def test_contract(n):
    run_suite(n, "tests/multirank/test_contract.py")


@pytest.mark.parametrize("n", [2, 4])
def test_semantics(n):
    run_suite(n, "tests/multirank/test_semantics.py")
