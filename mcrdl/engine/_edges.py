"""Dependency edges, as an operation is submitted (rule 3 of docs/design.md): ``after=`` and
the hazards found on its bytes become edges to operations submitted before it, and it waits
for those to end. An edge to one that failed fails it at once (its dependant would read or
overwrite what never arrived); a zombie's bytes (an operation given up while its backend
may still write them) are waited for until the zombie is buried.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..core._errors import DependencyFailedError
from ._future import CommFuture
from ._states import DONE, STATE_NAMES

__all__ = ["Edges"]


class Edges:
    """The engine's dependency edges (a part of `Engine`, with its lock held but for
    ``_check_after``)."""

    if not TYPE_CHECKING:  # (the engine declares the slots: it has no __dict__)
        __slots__ = ()

    _work: deque[tuple[CommFuture, BaseException | None]]
    _zombies: dict[CommFuture, None]
    log: list[tuple[Any, ...]] | None
    log_edges: list[tuple[Any, ...]]

    if TYPE_CHECKING:  # the engine's other parts
        def _bury(self, fut: CommFuture) -> bool: ...

    def _check_after(self, after: Iterable[CommFuture]) -> tuple[CommFuture, ...]:
        after = tuple(after)
        for dep in after:
            if not isinstance(dep, CommFuture):
                raise TypeError(
                    f"after= takes CommFutures, got {type(dep).__qualname__}: {dep!r}"
                )
            if getattr(dep, "_engine", None) is not self:
                raise ValueError(f"after= got {dep!r}, a future of another runtime")
        return after

    def _edges(self, fut: CommFuture, after: tuple[CommFuture, ...],
               deps: dict[CommFuture, None] | None) -> dict[CommFuture, None] | None:
        """``deps`` with ``after=`` added and the buried zombies left out; None (and ``fut``
        failed) if one of them failed already, or is a zombie whose bytes ``fut`` touches."""
        deps = dict(deps) if deps else {}
        for dep in after:
            deps[dep] = None
        for dep in [d for d in deps if d in self._zombies]:
            if self._bury(dep):
                del deps[dep]
        for dep in deps:
            state = dep._state
            if state <= DONE:
                continue
            if dep in self._zombies:
                why = (f"touches bytes that {dep.kind}#{dep.seq} on "
                       f"{dep.lane.backend_name} may still write: it was given up while "
                       f"issued ({dep._error}), and its backend cannot cancel it")
            else:
                why = (f"depends on {dep.kind}#{dep.seq}, which "
                       f"{STATE_NAMES[state].lower()}: {dep._error}")
            self._work.append((fut, DependencyFailedError(
                f"{fut.kind}#{fut.seq} on {fut.lane.backend_name} {why}")))
            return None
        return {dep: None for dep in deps if dep._state < DONE}

    def _depend(self, fut: CommFuture, deps: dict[CommFuture, None]) -> None:
        """``fut`` waits for ``deps`` to end."""
        fut._deps_left += len(deps)
        if self.log is not None:
            self.log_edges.extend((d.lane, d.seq, fut.lane, fut.seq) for d in deps
                                  if d.lane is not fut.lane)
        for dep in deps:
            dependants = dep._dependants
            if dependants is None:
                dep._dependants = [fut]
            else:
                dependants.append(fut)
