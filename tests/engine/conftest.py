"""Fixtures of the engine tests: an engine on a fake clock, and manual backends named like
the real ones (an MPI-like one, and a gloo-like one that progresses on threads of its own)."""

from __future__ import annotations

import pytest

from mcrdl.engine import Engine
from tests.engine.support import Clock
from tests.manual_backend import ManualBackend


@pytest.fixture
def clock() -> Clock:
    return Clock()

@pytest.fixture
def engine(clock: Clock) -> Engine:
    return Engine(background=False, clock=clock)

@pytest.fixture
def mpi() -> ManualBackend:
    return ManualBackend(name="mpi")

@pytest.fixture
def gloo() -> ManualBackend:
    return ManualBackend(name="gloo", self_progressing=True)
