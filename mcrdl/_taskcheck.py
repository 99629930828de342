"""The task check: a warning when two asyncio tasks have unnamed collectives unfinished on one
communicator at once (``init(check_tasks=True)`` or ``MCRDL_CHECK_TASKS=1``).

Unnamed collectives must reach each communicator in one order on every rank (rule 8 of
DESIGN.md). Concurrent tasks submit in an order that timing decides, which differs between
ranks, so two tasks' collectives of equal shape may be paired across tasks without any error.
Debug mode catches such a swap across the ranks, for one small allgather per collective. This
check is the cheap local one: it only looks at this rank's own submissions (one call per
operation, nothing when off), and warns, once per communicator and backend (the lane its
collectives are paired on), when a task submits an unnamed collective while another task's is
still unfinished there. The fix is ``name=`` on both (or submitting them from one task).

It can warn on a program that happens to be safe: tasks created in one order on every rank
that each submit before their first ``await`` reach the communicator in creation order. And it
misses a swap of collectives that never overlap on any rank: two tasks whose collectives run
one after the other, in opposite orders on two ranks (each rank's first pairs with the
other's first). Only debug mode sees that one.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from pathlib import Path
from typing import Any

from ._types import COLLECTIVES
from .engine import CommFuture

__all__ = ["TaskCheck", "TaskOrderWarning"]

_KINDS = frozenset(kind.value for kind in COLLECTIVES)
_PACKAGE = str(Path(__file__).resolve().parent)


class TaskOrderWarning(UserWarning):
    """Two asyncio tasks had unnamed collectives unfinished on one communicator at once."""


class TaskCheck:
    """An engine observer (``Engine.observe``) that warns as the module docstring says."""

    def __init__(self) -> None:
        #: Per lane, by (communicator, backend) name (its collectives are paired on it; a
        #: name keeps no object alive): its unnamed collectives submitted from tasks and
        #: unfinished, each with its task (a done-callback takes it out).
        self._pending: dict[tuple[str, str], dict[CommFuture, asyncio.Task[Any]]] = {}
        self._warned: set[tuple[str, str]] = set()

    def __call__(self, fut: CommFuture, after: tuple[CommFuture, ...]) -> None:
        if fut.name is not None or fut.kind not in _KINDS:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop runs in this thread
            return
        if task is None:
            return
        lane = fut.lane
        key = (lane.comm.name, lane.backend_name)
        pending = self._pending.setdefault(key, {})
        if key not in self._warned:
            # (a snapshot: done-callbacks may run in the progress thread meanwhile)
            for other, other_task in list(pending.items()):
                if other_task is not task:
                    self._warned.add(key)
                    warnings.warn(TaskOrderWarning(
                        f"{fut.kind} from task {task.get_name()!r} reaches communicator "
                        f"{lane.comm.name} on {lane.backend_name} while {other.kind} from task "
                        f"{other_task.get_name()!r} is unfinished there, both without a name: "
                        f"concurrent tasks reach a communicator in an order that timing "
                        f"decides, which may differ between ranks, and collectives are paired "
                        f"by that order. Pass name= to both (matched by name across the "
                        f"ranks), or submit them from one task"), stacklevel=_caller_level())
                    break
        pending[fut] = task
        fut.add_done_callback(lambda f: pending.pop(f, None))


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside mcrdl (the caller's submission)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
