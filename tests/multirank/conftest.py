"""Fixtures for the suites that run inside every rank of an ``mpiexec`` launch."""

from __future__ import annotations

import pytest

import mcrdl


@pytest.fixture(scope="session")
def world():
    comm = mcrdl.init()
    yield comm
    mcrdl.finalize()


@pytest.fixture(scope="module")
def comm(world):
    """A communicator of its own per test module: a failed module cannot desync the next."""
    sub = world.split(0)
    yield sub
    sub.close()
