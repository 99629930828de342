"""Marks every test of torch's suite but the default subset ``torch_suite``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests.torch_suite.test_torch_distributed_suite import DEFAULT

    for item in items:
        if "torch_suite" in str(item.fspath) and item.name not in DEFAULT:
            item.add_marker(pytest.mark.torch_suite)
