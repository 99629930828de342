"""Drivers: who calls ``Engine.poll``; each carries out the engine's idle decision (`_idle`).

Three drivers share the engine:

- the thread that waits (``fut.wait()``) polls itself. Handing the wait to another thread was
  rejected: a thread hand-off costs many times a small MPI operation;
- a task that awaits (``await fut``) polls from the running event loop, giving the loop back
  between polls with a bare ``yield`` (one loop iteration, no thread hop); a long wait it
  hands to the background thread, which resolves an asyncio future through
  ``call_soon_threadsafe``, so that the loop can sleep;
- a background thread polls only while nobody else does, so that communication advances
  while the caller computes; it parks whenever a waiter drives or nothing is in flight.

Each polls with its operation in focus (`Engine.poll`), asks the engine what to do whenever a
poll moved nothing (`Idling.idle`, `Idling.idle_background`), and does it.
"""

from __future__ import annotations

import _thread
import asyncio
import logging
import os
import threading
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from ..core._errors import RuntimeFinalizedError
from ._idle import (
    AWAIT,
    BLOCK,
    GIVE_WAY,
    HAND_OFF,
    PARK,
    SCHEDULE,
    SLEEP,
    SPIN,
    WAIT,
    WAIT_WORK,
)
from ._states import DONE

if TYPE_CHECKING:
    from ._core import Engine
    from ._future import CommFuture

__all__ = ["ProgressThread", "drive_async", "wait"]

_clock = time.perf_counter
_log = logging.getLogger("mcrdl")
_sched_yield = os.sched_yield
_sleep = time.sleep


def wait(engine: Engine, fut: CommFuture, timeout: float | None, until: int = DONE) -> None:
    """Poll from the calling thread until ``fut`` is done (or, with ``until=ISSUED``, issued)
    or ``timeout`` seconds passed."""
    poll = engine.poll
    focus = fut if until == DONE else None
    # Counted as a driver throughout, so that the background thread keeps off: a test of a
    # large message moves a chunk of it, and the polls of both would fight for the lock.
    engine.drivers += 1
    polls = 0
    t0 = 0.0
    try:
        while fut._state < until:
            if poll(focus):
                polls = 0
                continue
            polls += 1
            if polls == 1:
                if engine.closed:
                    raise RuntimeFinalizedError(
                        f"cannot wait on {fut!r}: the runtime was finalized "
                        f"({engine._closed_why})")
                if not t0:
                    t0 = _clock()
                    engine.waiting.append(fut)
            now = _clock()
            if timeout is not None and now - t0 >= timeout:
                raise TimeoutError(
                    f"{fut!r} did not finish within {timeout} s; it is still in flight")
            action, seconds = engine.idle(fut, now - t0, polls, WAIT)
            if action == SPIN:
                continue
            if action == GIVE_WAY:
                _sleep(seconds) if seconds else _sched_yield()
            elif action == SLEEP:
                _sleep(seconds)
            elif action == BLOCK:
                if timeout is not None:
                    seconds = min(seconds, t0 + timeout - now)
                engine.block(fut, seconds)
            elif action == SCHEDULE:
                engine.idle_hook()  # type: ignore[misc]
    finally:
        engine.drivers -= 1
        if t0:
            engine.waiting.remove(fut)
        engine.last_active = fut.t_done if fut._state >= DONE else _clock()


def _set_none(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def drive_async(engine: Engine, fut: CommFuture) -> Generator[Any, None, None]:
    """The body of ``await fut``: poll from the running event loop until ``fut`` is done.

    Between polls that moved nothing, the task gives the loop one iteration where the engine
    says to give way (and sleeps in it, blocks in a short slice, or hands the wait to the
    background thread where it says so). Past its first polls, a task polls only if nobody
    else polled since its last turn: another awaiting task of the loop, or a thread, makes the
    same progress, and each more poll costs its task a poll for nothing.
    """
    if engine.closed and fut._state < DONE:
        raise RuntimeFinalizedError(
            f"cannot await {fut!r}: the runtime was finalized ({engine._closed_why})")
    placement = fut._placement
    if placement is not None and placement.gathers:
        # One loop iteration first, in which sibling tasks submit theirs, so that one
        # agreement round takes them all (`Names`).
        yield
    poll = engine.poll
    handed = -1.0
    polls = 0
    t0 = 0.0
    mark = -1
    engine.drivers += 1
    try:
        while fut._state < DONE:
            if t0 and engine._n_polls != mark:  # polled by somebody else since our turn
                mark = engine._n_polls
                yield
                continue
            if poll(fut):
                mark = engine._n_polls
                polls = 0
                continue
            mark = engine._n_polls
            polls += 1
            now = _clock()
            if not t0:
                t0 = now
                engine.waiting.append(fut)
            action, seconds = engine.idle(fut, now - t0, polls, AWAIT)
            if action == SPIN:
                continue
            if action == HAND_OFF:
                handed = seconds
                break
            if action == GIVE_WAY:
                _sleep(seconds) if seconds else _sched_yield()
            elif action == SLEEP:
                yield from asyncio.sleep(seconds).__await__()
                continue
            elif action == BLOCK:
                engine.block(fut, seconds)
                if fut._state >= DONE:
                    return
            elif action == SCHEDULE:
                engine.idle_hook()  # type: ignore[misc]
            yield  # one event-loop iteration for the other tasks
    finally:
        engine.drivers -= 1
        if t0:
            engine.waiting.remove(fut)
    if fut._state >= DONE:
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    fut.add_done_callback(lambda _: loop.call_soon_threadsafe(_set_none, waiter))
    engine.wake_background(fut if handed > 0 else None)
    engine.waiting.append(fut)
    try:
        yield from waiter
    finally:
        engine.waiting.remove(fut)


class ProgressThread:
    """Polls the engine while work is in flight and no waiter drives it.

    Waking a thread costs its waker a GIL hand-off later, so submissions do not wake it: a
    recently active thread naps and finds new work by itself; only after ``deep_idle`` seconds
    without work does it sleep until a submission wakes it (``deep``). An awaiting task that
    hands its wait over wakes it at once (``wanted``).

    Invariants:
    - ``parked`` is True only while the thread is blocked (or about to block) on ``_wake``;
      ``deep`` only while it blocks without a timeout.
    - the thread is started on the first ``wake()`` and is a daemon: a process that never
      finalizes still exits.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._wake = _thread.allocate_lock()
        self._wake.acquire()
        self._stop = False
        self._thread: threading.Thread | None = None
        #: True while the thread waits to be woken (set before it blocks).
        self.parked = True
        #: True while it waits without a timeout: only a wake() brings it back.
        self.deep = True
        #: A lone operation an awaiting task handed over: block in its backend for it.
        self.lone: CommFuture | None = None
        #: Set by ``wake()``, and by a wait handed over (``Engine.wake_background``) before it
        #: reads ``parked``: a park that starts meanwhile returns at once, and the next turn
        #: starts its naps afresh.
        self.wanted = False
        #: Its pacing, which the engine's decision reads (`Idling.idle_background`): parks in
        #: a row for lack of anything to poll, polls in a row that moved nothing, and since
        #: when it has seen no work.
        self._parks = 0
        self._polls = 0
        self._idle_since = 0.0

    def wake(self) -> None:
        """Unpark the thread (start it the first time)."""
        if self._thread is None:
            if self._stop:
                return
            self._thread = threading.Thread(target=self._run, name="mcrdl-progress", daemon=True)
            self._thread.start()
        self.parked = self.deep = False
        self.wanted = True  # (its next turn naps short: it resets its own naps)
        try:
            self._wake.release()
        except RuntimeError:  # released already and not yet taken: it will not block
            pass

    def stop(self) -> None:
        """Stop and join the thread."""
        self._stop = True
        thread = self._thread
        if thread is not None:
            self.wake()
            thread.join(timeout=5.0)

    def _park(self, timeout: float, *, for_work: bool = False) -> None:
        """Block until woken or ``timeout`` (< 0: no timeout).

        ``for_work``: parked because nothing was in flight; then re-check after publishing
        ``parked``, so that work submitted just before is not missed. (A back-off park must
        not re-check: with work in flight it would return at once, and the thread would spin,
        fighting the caller for the GIL.)
        """
        engine = self._engine
        self.parked = True
        self.deep = timeout < 0
        if self._stop or self.wanted or (for_work and engine.in_flight()):
            self.parked = self.deep = False
            return
        self._wake.acquire(True, timeout)
        self.parked = self.deep = False

    def _run(self) -> None:
        engine = self._engine
        self._idle_since = _clock()
        while not self._stop:
            try:
                self._step(engine)
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                _log.error("mcrdl's progress thread caught an unexpected error and goes on",
                           exc_info=True)
                _sleep(engine.policy.background_max)

    def _step(self, engine: Engine) -> None:
        """One turn of the thread: carry out the engine's decision."""
        if self.wanted:  # woken, or a wait handed over: look again soon, whatever it finds
            self.wanted = False
            self._parks = 0
        lone = self.lone
        action, seconds = engine.idle_background(
            _clock() - self._idle_since, self._parks, self._polls, False, lone)
        if lone is not None:  # a wait handed over: block in it while the engine says so
            if action == BLOCK:
                engine.block(lone, seconds)
            else:
                self.lone = None
            return
        if action == WAIT_WORK:
            self._park(seconds, for_work=True)
            if seconds < 0:  # (the wake() that ends it marks it wanted)
                self._idle_since = _clock()
            else:
                self._parks += 1
            self._polls = 0
            return
        self._idle_since = _clock()
        if action == PARK:
            self._park(seconds)
            self._parks += 1
        else:  # POLL, then the pause the engine gives after it
            self._parks = 0
            moved = engine.poll() or engine.needs_polls()
            self._polls = 0 if moved else self._polls + 1
            _, seconds = engine.idle_background(0.0, 0, self._polls, True)
            _sleep(seconds)
