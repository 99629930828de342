"""CommFuture: one operation, as the front describes it and as the engine advances it.

Every operation is one small object (as asyncio's ``Handle`` is one per callback): the front
fills in what to run and what it touches (the *descriptor*: kind, lane, how to start it, its
byte ranges, its result), hands it to ``Engine.submit``, and the caller gets the same object
back as its future. Observers of submissions (``Engine.observe``: record/replay, logging) read
the descriptor; the engine owns the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

from ..core._errors import InvalidStateError
from ._drivers import drive_async as _drive_async
from ._drivers import wait as _wait
from ._lanes import ANY_PEER
from ._states import CANCELLED, DONE, FAILED, ISSUED, PENDING, STATE_NAMES

if TYPE_CHECKING:
    from ._core import Engine
    from ._lanes import Lane

__all__ = ["CANCELLED", "DONE", "FAILED", "ISSUED", "PENDING", "STATE_NAMES", "CommFuture",
           "Placement", "report_callback_error"]

_log = logging.getLogger("mcrdl")
Ranges = tuple[tuple[int, int], ...]


class Placement(Protocol):
    """What places an operation in a lane once its dependencies have finished, where its
    place is not known at submission: a routed operation's `Route` (its lane is chosen by
    what a dependency produces) and a communicator's `Names` (its members agree on the
    order). Every method runs with the engine's lock held."""

    #: Whether it gathers operations that tasks submit in a burst (an awaiting task gives
    #: its event loop one iteration before it drives, so that its siblings submit theirs).
    gathers: bool

    def ready(self, fut: CommFuture) -> None:
        """``fut``'s dependencies have finished: place it (or offer it to be placed)."""

    def drop(self, fut: CommFuture) -> None:
        """``fut`` ended before it was placed."""

    def position(self, fut: CommFuture, lane: Lane) -> int | None:
        """The position ``fut`` holds on ``lane`` until it is placed (None: none there)."""


def report_callback_error(fn: Callable[..., object], fut: CommFuture) -> None:
    """Log the exception a done-callback raised (call from its ``except``), as asyncio's
    exception handler does: a callback's failure is its own, never its caller's."""
    _log.error("Exception in done-callback %r of %r", fn, fut, exc_info=True)


class CommFuture:
    """One submitted operation: awaitable, waitable, and a node of the engine's DAG.

    Use ``y = await fut`` in asyncio code and ``y = fut.wait()`` in ordinary code; both drive
    the engine's progress from the waiting thread. The operation was submitted when the future
    was returned; nothing the caller does with the future changes what is sent.

    The descriptor (set by the front before ``Engine.submit``):
        kind: the operation (``"allreduce"``), seq: its number on its communicator,
        lane: where it is issued, stream: None for a collective (matched by its position in
        the lane), ``(peer, tag, sends)`` for a send or receive (matched by its position
        among those of the same peer, tag and direction), start and args: ``start(*args)``
        issues it and returns the
        backend's request, reads and writes: the byte ranges it touches, nbytes: what it
        moves, finish: run on success before it resolves (an emulated AVG's division; a
        receive from any source taking its position, `take_source`),
        hold: what else must stay alive while the backend may use it (the caller's objects it
        reads or writes by address, besides the result), name: the name its members match
        it by (``name=``; None for an operation matched by its position), device: the
        `Device` its buffers are on (None: host memory), whose caller's current stream the
        engine records an event on at submission.

    Invariants:
    - state moves PENDING -> ISSUED -> {DONE, FAILED}, or PENDING -> {FAILED, CANCELLED};
      never back.
    - ``_callbacks`` is None once the state is terminal; registration and settling both hold
      the engine's lock, and a late add_done_callback runs at once.
    - ``start`` and ``args`` are set while PENDING only; ``hold`` until the backend is done
      with the memory (past the end, for an issued operation the engine gave up on).
    - ``_deps_left`` counts unfinished dependencies; the engine issues the operation only when
      it is 0 and the operation is the oldest unissued one of its lane.
    - ``_dependants`` lists the futures that counted this one in their ``_deps_left`` and
      wait for its end; ``_on_stream`` those that went on once it was queued on its stream,
      their streams waiting on ``event`` (its failure fails them too).
    - ``_placement`` is set while the operation has no place in a lane yet: its lane is
      chosen once its dependencies have finished (a `Route`), or its members agree on its
      place (the communicator's `Names`); None once placed, and for every other operation.
    - ``index`` is its position among its lane's collectives (or its stream's operations),
      from 1, the same on every member: the peers match by it (set at submission).
    - ``waits`` (None, or a list) holds the device events it must not run before: the
      caller's stream at submission, and the ends of the stream-ordered operations it
      depends on that were queued when it was released. On a stream lane its stream waits
      on them; on a host lane it is issued once the engine has seen them reached.
    - ``event`` is set when it is issued on a stream lane: reached on that stream once the
      operation has run (what dependants on the device and ``wait_stream`` wait on).
    - ``carried`` lists the operations fused into this one (`mcrdl.engine._fusion`), each
      with ``carrier`` set to it: they are issued with it (no request of their own, in no
      track) and end when it ends, with its outcome.
    """

    __slots__ = (
        # the descriptor
        "kind",
        "seq",
        "lane",
        "stream",
        "start",
        "args",
        "reads",
        "writes",
        "nbytes",
        "finish",
        "hold",
        "name",
        "device",
        # the engine's
        "_engine",
        "_state",
        "_result",
        "_error",
        "_callbacks",
        "_deps_left",
        "_dependants",
        "_on_stream",
        "_request",
        "_placement",
        "index",
        "t_submit",
        "t_issue",
        "t_done",
        "waits",
        "event",
        "carried",
        "carrier",
    )

    # Set when they come to exist: by submit, at issue, at the end.
    _engine: Engine
    index: int
    _error: BaseException | None
    _request: Any
    t_submit: float
    t_done: float

    def __init__(
        self,
        kind: str,
        lane: Lane,
        seq: int,
        start: Callable[..., Any] | None,
        args: tuple[Any, ...] | None,
        reads: Ranges,
        writes: Ranges,
        result: Any,
        nbytes: int,
        finish: Callable[[CommFuture], None] | None = None,
        hold: Any = None,
        stream: Any = None,
    ) -> None:
        self.kind = kind
        self.seq = seq
        self.lane = lane
        self.stream = stream
        self.start = start
        self.args = args
        self.reads = reads
        self.writes = writes
        self.nbytes = nbytes
        self.finish = finish
        self.hold = hold
        self.name: str | None = None
        self.device: Any = None
        self.waits: list[Any] | None = None
        self.event: Any = None
        self.carried: list[CommFuture] | None = None
        self.carrier: CommFuture | None = None
        self._state = PENDING
        self._result = result
        # () until the first callback arrives (no list per operation), None once terminal.
        self._callbacks: list[Callable[[CommFuture], object]] | tuple[()] | None = ()
        self._deps_left = 0
        self._dependants: list[CommFuture] | None = None
        self._on_stream: list[CommFuture] | None = None
        self._placement: Placement | None = None
        self.t_issue = 0.0

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"PENDING"``, ``"ISSUED"``, ``"DONE"``, ``"FAILED"`` or ``"CANCELLED"``."""
        return STATE_NAMES[self._state]

    @property
    def source(self) -> int | None:
        """For a receive, the rank (in its communicator) its message came from: the one it
        named, or for a receive from any source the one that sent it, once it finished
        (None before). None for every other operation."""
        stream = self.stream
        if stream is None or stream[2] or stream[0] == ANY_PEER:
            return None
        return stream[0]  # type: ignore[no-any-return]

    def done(self) -> bool:
        """True once the operation finished, failed or was cancelled."""
        return self._state >= DONE

    def cancelled(self) -> bool:
        """True if the operation was cancelled."""
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
        """Call ``fn(self)`` once the future is done (at once, here, if it is already).

        Callbacks run in whichever thread drives the engine when the operation finishes,
        after the engine's lock is released; they may submit new operations. One that raises
        is reported through the ``mcrdl`` logger and never reaches the waiter or the other
        callbacks. Never call this from a ``finish`` step (it holds the engine's lock).
        """
        with self._engine._lock:  # the settle swaps _callbacks under it: nothing is lost
            callbacks = self._callbacks
            if callbacks is not None:
                if callbacks:
                    callbacks.append(fn)
                else:
                    self._callbacks = [fn]
                return
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - reported, as for every callback
            report_callback_error(fn, self)

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
        engine = self._engine
        if engine.wait_observer is not None:
            engine.wait_observer(self)
        if self._state < DONE:
            # Most small operations end in the first poll: the driver starts only after it.
            engine.poll(self)
            if self._state < DONE:
                _wait(engine, self, timeout)
        return self.result()

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the caller's current stream on the operation's device)
        wait for the operation, without blocking the host where the device allows it.

        Work queued on that stream afterwards sees the operation's result. The host waits only
        until the operation has been queued on its lane's stream; for an operation that runs on
        the host (MPI, gloo), or one with a finishing step on the host (an emulated AVG), it
        waits for the operation itself, as ``wait()`` does. For an operation on host memory
        there is no stream: this is ``wait()`` without the result.

        Raises:
            Exception: whatever failed the operation (or failed it before it was queued).
        """
        engine = self._engine
        lane = self.lane
        if lane.stream is None or self.finish is not None or self._state >= DONE:
            self.wait()
            return
        if self._state < ISSUED:
            _wait(engine, self, None, ISSUED)
        if self._state > DONE:
            self.result()  # raises its error
        device = lane.device
        device.wait(device.current_stream() if stream is None else stream, self.event)

    def __await__(self) -> Generator[Any, None, Any]:
        # Cancelling the awaiting task stops the waiting, never the operation: its peers
        # match it whatever this task does next. As in wait(), one poll first, but for an
        # operation not placed yet: a named one waits for its sibling tasks' first (they go
        # in one agreement round), and its round is posted by a poll.
        engine = self._engine
        if engine.wait_observer is not None:
            engine.wait_observer(self)
        if self._state < DONE:
            if self._placement is None:
                engine.poll(self)
            if self._state < DONE:
                yield from _drive_async(engine, self)
        return self.result()

    def cancel(self) -> bool:
        """Cancel the operation; False if it has finished already.

        Its peers match it by its position on the communicator, so a cancelled operation
        breaks its communicator on every member (unless it has no peers): the other
        unfinished and later operations on it fail with CommBrokenError, naming this
        cancellation. Its dependants fail with DependencyFailedError.

        Raises:
            InvalidStateError: the operation was issued and its backend cannot cancel it.
        """
        return self._engine.cancel(self)

    def __repr__(self) -> str:
        lane = self.lane
        deps = f" deps={self._deps_left}" if self._deps_left else ""
        named = f" {self.name!r}" if self.name is not None else ""
        return (
            f"<CommFuture {self.kind}#{self.seq}{named} {STATE_NAMES[self._state]} on "
            f"{lane.backend_name}"
            f" lane={lane.comm_name} rank={lane.rank}/{lane.size}{deps}>"
        )
