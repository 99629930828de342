"""CommFuture: the one thing every operation returns; a node of the engine's dependency DAG."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from .._errors import InvalidStateError

if TYPE_CHECKING:
    from ._lanes import Lane
    from ._progress import Engine

__all__ = ["CANCELLED", "DONE", "FAILED", "ISSUED", "PENDING", "STATE_NAMES", "CommFuture"]

from ._drivers import wait as _wait
from ._states import CANCELLED, DONE, FAILED, ISSUED, PENDING, STATE_NAMES


class CommFuture:
    """The result of one submitted operation: awaitable, waitable, and a node of the DAG.

    Use ``y = await fut`` in asyncio code and ``y = fut.wait()`` in ordinary code; both drive
    the engine's progress from the waiting thread. The operation was submitted when the future
    was made; nothing the caller does with the future changes what is sent.

    Invariants:
    - state moves PENDING -> ISSUED -> {DONE, FAILED}, or PENDING -> {FAILED, CANCELLED};
      never back.
    - ``_callbacks`` is None once the state is terminal; a late add_done_callback runs at once.
    - ``_start`` and ``_args`` are set while PENDING only; ``_hold`` (the caller's objects the
      backend uses by address, besides ``_result``) until the state is terminal.
    - ``_deps_left`` counts unfinished dependencies; the engine issues the operation only when
      it is 0 and the operation is the oldest unissued one of its lane.
    - ``_dependants`` lists the futures that counted this one in their ``_deps_left``.
    """

    __slots__ = (
        "_engine",
        "_state",
        "_result",
        "_error",
        "_callbacks",
        "kind",
        "seq",
        "lane",
        "_start",
        "_args",
        "_hold",
        "_finish",
        "_deps_left",
        "_dependants",
        "_reads",
        "_writes",
        "_request",
        "t_submit",
        "t_issue",
        "t_done",
        "nbytes",
    )

    # Set when they come to exist (see __init__); _hold only where there is one.
    _error: BaseException | None
    _request: Any
    _hold: Any
    t_done: float

    def __init__(
        self,
        engine: Engine,
        kind: str,
        lane: Lane,
        seq: int,
        start: Callable[..., Any] | None,
        args: tuple[Any, ...] | None,
        reads: tuple[tuple[int, int], ...],
        writes: tuple[tuple[int, int], ...],
        result: Any,
        finish: Callable[[CommFuture], None] | None,
        nbytes: int,
        t_submit: float,
    ) -> None:
        # Only what is read before the operation finishes is set here (this runs for every
        # operation); _error, _request and t_done are set when they come to exist.
        self._engine = engine
        self._state = PENDING
        self._result = result
        # () until the first callback arrives (no list per operation), None once terminal.
        self._callbacks: list[Callable[[CommFuture], object]] | tuple[()] | None = ()
        self.kind = kind
        self.lane = lane
        self.seq = seq
        self._start = start
        self._args = args
        self._reads = reads
        self._writes = writes
        self._finish = finish
        self._deps_left = 0
        self._dependants: list[CommFuture] | None = None
        self.nbytes = nbytes
        self.t_submit = t_submit
        self.t_issue = 0.0

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"PENDING"``, ``"ISSUED"``, ``"DONE"``, ``"FAILED"`` or ``"CANCELLED"``."""
        return STATE_NAMES[self._state]

    def done(self) -> bool:
        """True once the operation finished, failed or was cancelled."""
        return self._state >= DONE

    def cancelled(self) -> bool:
        """True if the operation was cancelled before it was issued."""
        return self._state == CANCELLED

    def result(self) -> Any:
        """The operation's result, without waiting.

        Raises:
            InvalidStateError: the operation has not finished (use ``wait()`` or ``await``).
            Exception: whatever failed the operation.
        """
        state = self._state
        if state == DONE:
            return self._result
        if state > DONE:
            raise self._error  # type: ignore[misc]  # set whenever state > DONE
        raise InvalidStateError(f"{self!r} has not finished; use wait() or await it")

    def exception(self) -> BaseException | None:
        """The exception that failed the operation, or None if it succeeded.

        Raises:
            InvalidStateError: the operation has not finished.
        """
        state = self._state
        if state < DONE:
            raise InvalidStateError(f"{self!r} has not finished; use wait() or await it")
        return None if state == DONE else self._error

    def add_done_callback(self, fn: Callable[[CommFuture], object]) -> None:
        """Call ``fn(self)`` once the future is done (at once if it is already).

        Callbacks run in whichever thread drives the engine when the operation finishes, after
        the engine's lock is released; they may submit new operations.
        """
        callbacks = self._callbacks
        if callbacks is None:
            fn(self)
        elif callbacks:
            callbacks.append(fn)
        else:
            self._callbacks = [fn]

    # -- waiting -------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes, driving progress meanwhile; return its result.

        Args:
            timeout: seconds to wait at most; None waits as long as the runtime's own
                per-operation timeout allows.

        Raises:
            TimeoutError: ``timeout`` passed first; the operation is still in flight.
            RuntimeFinalizedError: the runtime was finalized before the operation finished.
            Exception: whatever failed the operation.
        """
        if self._state < DONE:
            # The commonest wait is on the only unfinished operation, on MPI: spin on it with
            # direct tests first (Engine.spin_lone), then poll the general way.
            engine = self._engine
            if not engine.spin_lone(self):
                _wait(engine, self, timeout)
        if self._state == DONE:
            return self._result
        return self.result()

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state < DONE:
            yield from self._engine.drive_async(self)
        return self.result()

    def cancel(self) -> bool:
        """Cancel the operation if it has not been issued; False if it has finished already.

        Its dependants fail with DependencyFailedError.

        Raises:
            InvalidStateError: the operation was issued and its backend cannot cancel it.
        """
        return self._engine.cancel(self)

    def __repr__(self) -> str:
        lane = self.lane
        deps = f" deps={self._deps_left}" if self._deps_left else ""
        return (
            f"<CommFuture {self.kind}#{self.seq} {STATE_NAMES[self._state]} on {lane.backend_name}"
            f" lane={lane.comm_name} rank={lane.rank}/{lane.size}{deps}>"
        )
