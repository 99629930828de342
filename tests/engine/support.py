"""Helpers of the engine tests: a fake clock, submission through the manual backend, backends
that block, count their tests, or cannot cancel, and stand-ins for the caller's buffers."""

from __future__ import annotations

import threading
import weakref
from dataclasses import replace

from mcrdl.engine import CommFuture
from tests.manual_backend import ManualBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

def submit(engine, backend, kind, reads=(), writes=(), after=(), comm="world", result=None,
           nbytes=0, hold=None):
    group = backend.world()
    lane = engine.lane(backend, group, engine.comm(comm, group.rank, group.size))
    seq = submit.seq = getattr(submit, "seq", 0) + 1
    fut = CommFuture(kind, lane, seq, getattr(backend, f"start_{kind}"), (kind,), tuple(reads),
                     tuple(writes), result, nbytes, hold=hold)
    return engine.submit(fut, after)

def finish(engine, backend, i, error=None):
    backend.finish(backend.started[i], error)
    engine.poll()

A = (0x1000, 0x1100)  # a buffer's byte range

B = (0x2000, 0x2100)

A_HALF = (0x1080, 0x1100)  # overlaps the second half of A

class Blocking(ManualBackend):
    """A gloo-like backend (self-progressing, can block in a request): every ``block`` is
    recorded as (thread, timeout, ``probe()``), and the ``finish_on``-th finishes the request."""

    def __init__(self, finish_on=1, probe=lambda: None):
        super().__init__(name="gloo", capabilities=replace(
            ManualBackend.capabilities, self_progressing=True, blocking_wait=True))
        self.finish_on, self.probe = finish_on, probe
        self.blocked = []

    def block(self, request, timeout):
        self.blocked.append((threading.current_thread(), timeout, self.probe()))
        finished = len(self.blocked) == self.finish_on
        if finished:
            self.finish(request)
        return finished

async def awaited(fut):
    return await fut

class Counting(ManualBackend):
    """Its requests finish (or fail) on the n-th test_one; the general test is counted."""

    def __init__(self, after: int, error: BaseException | None = None, **kw):
        super().__init__(**kw)
        self.after, self.error = after, error
        self.one_tests = self.tests = 0

    def test_one(self, request):
        self.one_tests += 1
        if self.one_tests >= self.after:
            if self.error is not None:
                raise self.error
            return True
        return False

    def test(self, requests):
        self.tests += 1
        return super().test(requests)

class Held:
    """Stands for a caller's buffer that a backend uses by address."""

class Holds:
    """Such stand-ins by name, and which of them are still alive."""

    def __init__(self):
        self.refs = {}

    def __call__(self, name):
        obj = Held()
        self.refs[name] = weakref.ref(obj)
        return obj

    def alive(self):
        return sorted(name for name, ref in self.refs.items() if ref() is not None)

class Uncancellable(ManualBackend):
    """Like MPI's collectives: an issued request cannot be cancelled."""

    def cancel(self, request):
        return False
