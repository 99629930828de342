"""A worker thread per lane for backends whose calls block until the peers arrive.

Rule 1 of docs/design.md: never block in a backend. A backend that only has blocking calls
(``capabilities.blocking_calls``) gets a thread per group, which is its lane: the engine's
``start_*`` only queues the call for that thread and returns a job, and ``test`` reports the
jobs the thread has finished. Calling the blocking function inline instead was rejected: a rank
stuck in it cannot issue the other lanes' operations its peers need first, a deadlock of a
well-formed program (tests/sim show it).

The threads come from a ``Threads`` object, so that the simulated world can run them under its
deterministic scheduler; ``RealThreads`` uses ordinary daemon threads.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..core._errors import StartError
from ..core._types import OpKind
from ._contract import Backend, Capabilities, Group, Request

__all__ = ["RealThreads", "ThreadedBackend", "Threads"]


class Threads(ABC):
    """How the adapter runs and parks its worker threads."""

    @abstractmethod
    def spawn(self, fn: Callable[[], None], name: str) -> None:
        """Run ``fn`` on a new thread."""

    @abstractmethod
    def condition(self) -> Any:
        """A condition variable (``threading.Condition`` protocol) for a worker's queue."""


class RealThreads(Threads):
    """Ordinary daemon threads."""

    def spawn(self, fn: Callable[[], None], name: str) -> None:
        threading.Thread(target=fn, name=name, daemon=True).start()

    def condition(self) -> Any:
        return threading.Condition()


class _Job:
    __slots__ = ("call", "args", "done", "error")

    def __init__(self, call: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.call = call
        self.args = args
        self.done = False
        self.error: BaseException | None = None


class _Worker:
    """One group's thread: runs its jobs one at a time, in the order they were queued.

    After a call that raised, it runs no more calls: they were queued before the engine
    learnt of the failure, and running one would let the peers match it in the failed one's
    place (rule 7 of docs/design.md). They fail with StartError instead.
    """

    def __init__(self, threads: Threads, name: str) -> None:
        self.jobs: deque[_Job | None] = deque()
        self.cond = threads.condition()
        self.failed: BaseException | None = None
        threads.spawn(self._run, name)

    def put(self, job: _Job | None) -> None:
        with self.cond:
            self.jobs.append(job)
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                job = self.jobs.popleft()
            if job is None:
                return
            if self.failed is not None:
                job.error = StartError(f"not started: an earlier operation of its group "
                                       f"failed ({self.failed})")
            else:
                try:
                    job.call(*job.args)
                except Exception as exc:  # noqa: BLE001 - reported through test()
                    job.error = self.failed = exc
            job.done = True
            with self.cond:  # a finished job is news (the simulated world counts it)
                self.cond.notify()


def _unstarted(name: str, error: BaseException | None) -> BaseException | None:
    """A blocking call that raised may have failed before it reached the peers: as far as
    they can tell, it never started (StartError breaks its communicator)."""
    if error is None or isinstance(error, StartError):
        return error
    wrapped = StartError(f"{name}: {error}")
    wrapped.__cause__ = error
    return wrapped


class _ThreadedGroup:
    __slots__ = ("inner", "worker", "rank", "size")

    def __init__(self, inner: Group, worker: _Worker) -> None:
        self.inner = inner
        self.worker = worker
        self.rank = inner.rank
        self.size = inner.size


def _make_start(op: str) -> Callable[..., Request]:
    def start(self: ThreadedBackend, group: _ThreadedGroup, *args: Any) -> Request:
        job = _Job(getattr(self.inner, f"start_{op}"), (group.inner, *args))
        group.worker.put(job)
        return job

    start.__name__ = f"start_{op}"
    start.__doc__ = f"Queue ``{op}`` for the group's worker thread."
    return start


class ThreadedBackend(Backend):
    """``inner``'s blocking calls, each group's on a thread of its own."""

    def __init__(self, inner: Backend, threads: Threads | None = None) -> None:  # noqa: D107
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.device = inner.device
        self._threads = threads or RealThreads()
        self.capabilities: Capabilities = replace(
            inner.capabilities, blocking_calls=False, self_progressing=True, blocking_wait=False,
            in_order=True,
        )
        self._groups: list[_ThreadedGroup] = []
        self._world = self._wrap(inner.world())

    @classmethod
    def is_available(cls) -> bool:
        return True

    def _wrap(self, group: Group) -> _ThreadedGroup:
        wrapped = _ThreadedGroup(group, _Worker(self._threads, f"mcrdl-{self.name}-lane"))
        self._groups.append(wrapped)
        return wrapped

    def world(self) -> _ThreadedGroup:
        return self._world

    def create_group(self, parent: _ThreadedGroup, members: Sequence[int], tag: str) -> Group:
        return self._wrap(self.inner.create_group(parent.inner, members, tag))

    def regroup(self, parent: _ThreadedGroup, members: Sequence[int], tag: str,
                store: Any) -> Group:
        return self._wrap(self.inner.regroup(parent.inner, members, tag, store))

    def free_group(self, group: _ThreadedGroup) -> None:
        group.worker.put(None)
        self.inner.free_group(group.inner)

    def host_only(self, op: OpKind, args: tuple[Any, ...]) -> bool:
        return self.inner.host_only(op, args)

    def test(self, requests: list[Request]) -> list[tuple[int, BaseException | None]]:
        return [(i, _unstarted(self.name, job.error)) for i, job in enumerate(requests)
                if job.done]

    def close(self) -> None:
        for group in self._groups:
            group.worker.put(None)
        self.inner.close()


for _kind in OpKind:
    setattr(ThreadedBackend, f"start_{_kind.value}", _make_start(_kind.value))
ThreadedBackend.__abstractmethods__ = frozenset()
