"""The task check: a warning when two asyncio tasks have unnamed collectives unfinished on one
communicator and backend at once (``init(check_tasks=True)`` or ``MCRDL_CHECK_TASKS=1``).

Unnamed collectives must reach each communicator in one order on every rank (rule 8 of
docs/design.md). Concurrent tasks submit in an order that timing decides, which differs between
ranks, so two tasks' collectives of equal shape may be paired across tasks without any error.
Debug mode catches such a swap across the ranks, for one small allgather per collective. This
check is the cheap local one. It looks only at this rank's own submissions: the front calls it
after each one (when it is off, that is one attribute test per submission). It warns, once per
communicator and backend name (the lane its collectives are paired on) for the runtime's life,
when a task submits an unnamed collective while another task's is still unfinished there. The
fix is ``name=`` on both (or submitting them from one task). The warning comes after the
operation was submitted, so a warnings filter that turns it into an error raises at the
caller's line with the operation in flight (its peers match it), never halfway through.

Its limits:
- it can warn on a program that happens to be safe: tasks created in one order on every rank
  that each submit before their first ``await`` reach the communicator in creation order;
- it misses a swap of collectives that never overlap on any rank: two tasks whose collectives
  run one after the other, in opposite orders on two ranks (each rank's first pairs with the
  other's first). Only debug mode sees that one;
- an alltoallv whose backend auto picks by its agreed total size is checked on the first of
  its candidate backends only;
- a collective submitted from a done-callback counts for whichever task was driving the
  engine when the callback ran.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from typing import Any

from ..core._types import COLLECTIVES
from ..engine import CommFuture

__all__ = ["TaskCheck", "TaskOrderWarning"]

_KINDS = frozenset(kind.value for kind in COLLECTIVES)
#: Where mcrdl's own frames come from (as code objects name their files: not resolved).
_PACKAGE = os.path.dirname(__file__) + os.sep


class TaskOrderWarning(UserWarning):
    """Two asyncio tasks had unnamed collectives unfinished on one communicator at once."""


class TaskCheck:
    """Called with every operation a communicator submitted without a name (a named one is
    matched by its name, and never comes here); warns as the module docstring says."""

    def __init__(self) -> None:
        #: Per lane, by (communicator, backend) name (its collectives are paired on it): its
        #: unnamed collectives submitted from tasks and unfinished, each with its task, until
        #: a done-callback takes it out.
        self._pending: dict[tuple[str, str], dict[CommFuture, asyncio.Task[Any]]] = {}
        self._warned: set[tuple[str, str]] = set()

    def __call__(self, fut: CommFuture) -> None:
        if fut.kind not in _KINDS:
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
        # (a snapshot: done-callbacks may run in the progress thread meanwhile)
        other = None if key in self._warned else next(
            ((f, t) for f, t in list(pending.items()) if t is not task), None)
        pending[fut] = task
        fut.add_done_callback(lambda f: pending.pop(f, None))
        if other is not None:
            self._warned.add(key)
            warnings.warn(TaskOrderWarning(
                f"{fut.kind} from task {task.get_name()!r} reaches communicator "
                f"{lane.comm.name} on {lane.backend_name} while {other[0].kind} from task "
                f"{other[1].get_name()!r} is unfinished there, both without a name: concurrent "
                f"tasks reach a communicator in an order that timing decides, which may differ "
                f"between ranks, and collectives are paired by that order. Pass name= to both "
                f"(matched by name across the ranks), or submit them from one task"),
                stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the caller's submission: the first frame outside mcrdl and, when
    the call came through the torch.distributed backend, outside torch."""
    skip = [_PACKAGE]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        skip.append(os.path.dirname(torch_file) + os.sep)
    prefixes = tuple(skip)
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back
        level += 1
    return level
