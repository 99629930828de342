"""The simulated world: N ranks in one process, each with its own real engine, run deterministically.

Every rank is a ``Runtime`` with the same engine, scheduler and DAG code as a real run; only
its backends are ``SimBackend`` objects sharing this world's state. Each rank's program runs
on a thread of its own, but only one thread runs at a time: the holder of the *baton*. A
thread hands the baton back to the scheduler whenever it would wait (the engine's idle hook,
a blocking simulated call, a worker with nothing to do); the scheduler then picks the next
thread with a random generator seeded by the caller, so a seed fixes the whole interleaving.

A run ends when every rank's program has returned. It fails with ``SimDeadlock`` when every
live thread has had a turn without anything moving and nothing is due later (the report says
what each rank waits for and which peers an operation still lacks), and with ``SimMismatch``
when members issue different collectives at the same position of a group.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends import Backend
from ..backends._threaded import Threads
from ..backends.sim import SimBackend, SimGroup, SimOp, reduce_stack
from ..bootstrap._agree import Meeting
from ..core._buffers import Buffer
from ..core._config import Config
from ..engine import Engine, PollPolicy
from ..engine._drivers import drive_async
from ..engine._fusion import carried
from ..front._runtime import Runtime
from ..observe._flight import flight_record
from ._device import KIND as SIM_KIND
from ._device import SimDevice
from ._sim_parts import Condition, Notices, Rendezvous, Store

if TYPE_CHECKING:
    from ..front._communicator import Communicator
    from ..front._select import Selector

__all__ = ["SimAborted", "SimDeadlock", "SimKilled", "SimMismatch", "SimWorld"]

_DRIVE_CODE = drive_async.__code__
#: Simulated seconds per scheduler step (the engines' clock, for timeouts).
STEP_SECONDS = 1e-3


class SimDeadlock(AssertionError):
    """Every simulated thread waits and nothing can move: the report says on what."""


class SimMismatch(AssertionError):
    """Members of a group issued different collectives at the same position."""


class SimAborted(BaseException):
    """Raised inside simulated threads to unwind them when a run is abandoned."""


def _closed_gate() -> threading.Lock:
    """A gate a thread waits at (``acquire``) until another opens it (``release``)."""
    gate = threading.Lock()
    gate.acquire()
    return gate


@dataclass(eq=False)
class _Thread:
    token: int
    name: str
    rank: int | None
    finished: bool = False
    result: Any = None
    error: BaseException | None = None
    wake_at: int = 0
    #: Where it waits for the baton: one gate per thread, so that handing the baton on wakes
    #: only its receiver (a shared condition woke every thread at every hand-over).
    gate: threading.Lock = field(default_factory=_closed_gate)


class SimKilled(BaseException):
    """Unwinds a simulated rank that `SimWorld.kill` ended (its process died)."""


class _SimThreads(Threads):
    def __init__(self, world: SimWorld) -> None:
        self._world = world

    def spawn(self, fn: Callable[[], None], name: str) -> None:
        self._world.spawn(fn, name, None)

    def condition(self) -> Any:
        return Condition(self._world)


class SimWorld:
    """``size`` simulated ranks with the given backends (name -> semantics), seeded.

    Args:
        size: number of ranks (1..64).
        backends: simulated backends by name, each of ``"mpi"``, ``"windowed"``, ``"nccl"``
            or ``"blocking"`` semantics (see ``mcrdl.backends.sim``; default: mpi windowed,
            gloo mpi, as the real ones behave); names like the real ones make
            ``backend="auto"`` behave as it does for real.
        seed: fixes the interleaving and every delay.
        max_delay: an operation finishes 0..max_delay scheduler steps after its last member
            arrives.
        stream: ``"lane"`` (a stream per group, as mcrdl does) or ``"backend"`` (one per
            backend and rank) for ``"nccl"`` semantics.
        engine_factory: replaces the engine of every rank (the test suite uses it to show
            that broken policies are caught); it takes `Engine`'s keyword arguments.
        selector_factory: replaces the selector of every rank, likewise.
        wrap_blocking: False calls blocking backends inline (a broken policy, for the tests).
        debug: check every collective's fingerprint (as ``MCRDL_DEBUG=1`` does).
        device: give every rank a simulated device (`mcrdl.testing._device`), which every
            backend reaches; implied by a backend of ``"stream"`` semantics.
        staged: backends (by name) that do not reach the device themselves: the runtime
            stages their operations on device buffers through host copies, as it does for
            MPI without CUDA support and for gloo (`mcrdl.backends._staging`).
        direct: backends (by name) that reach the device for every operation but their
            reductions, which need host memory (as a CUDA-aware MPI's half-precision ones):
            the runtime hands them device buffers as they are and stages the reductions.
        staging: replaces that staging adapter (a broken one, for the tests).
        timeout: the per-operation timeout in simulated seconds (a scheduler step is
            ``STEP_SECONDS``); None: none.
    """

    def __init__(
        self,
        size: int,
        backends: Mapping[str, str] | None = None,
        *,
        seed: int = 0,
        max_delay: int = 3,
        stream: str = "lane",
        engine_factory: Callable[..., Engine] | None = None,
        selector_factory: Callable[[int, tuple[str, ...]], Selector] | None = None,
        wrap_blocking: bool = True,
        max_steps: int = 200_000,
        debug: bool = False,
        timeout: float | None = None,
        device: bool = False,
        staged: Collection[str] = (),
        direct: Collection[str] = (),
        staging: Callable[..., Backend] | None = None,
    ) -> None:
        if not 1 <= size <= 64:
            raise ValueError(f"size={size}: a simulated world has 1 to 64 ranks")
        if stream not in ("lane", "backend"):
            raise ValueError(f"stream={stream!r}: choose 'lane' or 'backend'")
        self.size = size
        self.backends = dict(backends or {"mpi": "windowed", "gloo": "mpi"})
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.max_delay = max_delay
        self.stream = stream
        self.max_steps = max_steps
        self.step = 0
        self.progress = 0
        self.mismatch: str | None = None
        self._sched_gate = _closed_gate()  # where the scheduler waits for the baton back
        self._threads: list[_Thread] = []
        self._by_ident: dict[int, _Thread] = {}
        self._aborted = False
        self._colls: dict[tuple[str, str], list[SimOp]] = {}
        self._coll_count: dict[tuple[str, str, int], int] = {}
        self._p2p: dict[tuple[str, str, int, int, int], list[SimOp]] = {}
        self._p2p_count: dict[tuple[str, str, int, int, int, str], int] = {}
        self._streams: dict[tuple[Any, ...], list[SimOp]] = {}
        self._pending: list[SimOp] = []
        self._faults: dict[int, tuple[str, Any]] = {}  # id(buffer object) -> (kind, object)
        #: id(host copy) -> (host copy, device array) for staged operations (both kept, so
        #: that the ids stay theirs).
        self._mirrors: dict[int, tuple[Any, Any]] = {}
        #: Each rank's simulated device (none: a world of host memory only).
        self.devices: list[SimDevice] = (
            [SimDevice(self, rank) for rank in range(size)]
            if device or "stream" in self.backends.values() else [])
        threads = _SimThreads(self)
        self.store = Store(self)
        #: Ranks `kill` ended, and the launcher's notices of them not yet delivered: (the
        #: step it reaches that rank, the rank it tells, the rank that died).
        self.killed: set[int] = set()
        self._notices: list[tuple[int, int, int]] = []
        self.runtimes: list[Runtime] = []
        for rank in range(size):
            sims = {name: SimBackend(Rendezvous(self, rank, name, sem))
                    for name, sem in self.backends.items()}
            if not wrap_blocking:
                for b in sims.values():
                    b.capabilities = _unblocked(b.capabilities)
            if "gloo" in sims:  # as the real one, whose alltoallv counts are checked first
                sims["gloo"].capabilities = replace(sims["gloo"].capabilities,
                                                    aborts_on_mismatch=True)
            for name in staged:
                sims[name].capabilities = replace(sims[name].capabilities,
                                                  devices=frozenset({"cpu"}))
            for name in direct:
                sims[name].capabilities = replace(sims[name].capabilities,
                                                  devices=frozenset({"cpu"}),
                                                  direct=frozenset({SIM_KIND}))
            # Its ranks progress only when the scheduler runs them: a waiter never spins.
            engine = (engine_factory or Engine)(
                background=False, policy=PollPolicy(spin_polls=0, burst=0),
                timeout=timeout, clock=self.clock)
            engine.idle_hook = self._idle
            selector = selector_factory(rank, tuple(sims)) if selector_factory else None
            config = Config(progress_thread=False, timeout=timeout, debug=debug)
            meeting = Meeting(self.store, rank, float("inf"), self._pause)
            self.runtimes.append(Runtime(config, None, sims, engine=engine, threads=threads,
                                         selector=selector, notices=Notices(self, rank, engine),
                                         meeting=meeting,
                                         **({} if staging is None else {"staging": staging})))

    def clock(self) -> float:
        """Simulated seconds: each scheduler step is STEP_SECONDS."""
        return self.step * STEP_SECONDS

    @property
    def comms(self) -> list[Communicator]:
        """Each rank's world communicator."""
        return [r.world for r in self.runtimes]

    # -- baton -------------------------------------------------------------------------

    def spawn(self, fn: Callable[[], Any], name: str, rank: int | None) -> None:
        """Start a simulated thread; it runs only when the scheduler hands it the baton."""
        t = _Thread(len(self._threads), name, rank)
        self._threads.append(t)
        real = threading.Thread(target=self._main, args=(t, fn), name=f"sim-{name}",
                                daemon=True)
        real.start()

    def _main(self, t: _Thread, fn: Callable[[], Any]) -> None:
        self._by_ident[threading.get_ident()] = t
        t.gate.acquire()
        try:
            if self._aborted:
                raise SimAborted()
            t.result = fn()
        except SimKilled:
            pass  # (its result stays None)
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            t.error = exc
        finally:
            t.finished = True
            self.progress += 1
            self._sched_gate.release()

    def yield_(self) -> None:
        """Hand the baton back to the scheduler (called from a simulated thread)."""
        t = self._by_ident[threading.get_ident()]
        self._sched_gate.release()
        t.gate.acquire()
        if self._aborted:
            raise SimAborted()

    def _idle(self) -> None:
        """An engine's idle hook: hand the baton back. A rank whose event loop has other
        work ready (a task woken by an asyncio event, or looping on ``asyncio.sleep(0)``,
        not one awaiting an operation) is not quiet: that work runs on its next turn, and
        may submit what a peer waits for, so this turn counts as progress."""
        if _loop_has_other_work():
            self.progress += 1
        self.yield_()

    def sleep(self, steps: int) -> None:
        """Let ``steps`` scheduler steps pass before this thread goes on (a per-rank delay)."""
        t = self._by_ident[threading.get_ident()]
        t.wake_at = self.step + steps
        while self.step < t.wake_at:
            self.yield_()

    def _pause(self, seconds: float) -> None:
        """A survivor waiting between two reads of the store lets the others run."""
        self.yield_()

    def kill(self) -> None:
        """End the calling rank as a killed process would end: it issues nothing more, and
        each other rank's launcher notice of it arrives after a delay of its own (up to
        ``max_delay`` steps), as the real ones arrive when each listener runs.

        Raises:
            SimKilled: always (it unwinds the rank's program).
            RuntimeError: it was called from a worker thread, not a rank's program.
        """
        rank = self._by_ident[threading.get_ident()].rank
        if rank is None:
            raise RuntimeError("kill() ends the rank whose program calls it; it was called "
                               "from a simulated worker thread, which belongs to no rank")
        self.killed.add(rank)
        for other in range(self.size):
            if other != rank and other not in self.killed:
                delay = int(self.rng.integers(self.max_delay + 1))
                self._notices.append((self.step + delay, other, rank))
        raise SimKilled(f"rank {rank} was killed")

    def _deliver(self) -> None:
        """Hand each due launcher notice to its rank's engine (every scheduler step)."""
        if not self._notices:
            return
        due = [n for n in self._notices if n[0] <= self.step]
        for notice in due:
            self._notices.remove(notice)
            _, to, lost = notice
            self.runtimes[to].engine.post_lost(lost, "its process was killed (simulated)")
            self.progress += 1

    def note_progress(self) -> None:
        """Something moved (the scheduler's deadlock detection counts these)."""
        self.progress += 1

    def _resume(self, t: _Thread) -> None:
        t.gate.release()
        self._sched_gate.acquire()

    # -- running -----------------------------------------------------------------------

    def run(self, program: Callable[[Communicator], Any]) -> list[Any]:
        """Run ``program(comm)`` on every rank; return each rank's result, in rank order.

        Raises:
            SimDeadlock, SimMismatch: see the module docstring.
            Exception: the first exception a rank's program raised.
        """
        comms = self.comms
        for rank in range(self.size):
            self.spawn((lambda c: lambda: program(c))(comms[rank]), f"rank{rank}", rank)
        ranks = [t for t in self._threads if t.rank is not None]
        quiet: set[int] = set()
        retried = -1
        try:
            while not all(t.finished for t in ranks):
                if self.mismatch is not None:
                    raise SimMismatch(self.mismatch)
                before = self.progress
                self._deliver()
                alive = [t for t in self._threads if not t.finished]
                t = alive[int(self.rng.integers(len(alive)))]
                for dev in self.devices:  # the devices run between the threads' turns
                    if dev.advance():
                        self.progress += 1
                self._resume(t)
                asleep = t.wake_at > self.step  # it is sleeping: no chance to act yet
                self.step += 1
                if self.step > self.max_steps:
                    raise SimDeadlock(f"no end after {self.max_steps} steps (livelock?)\n"
                                      + self.report())
                failed = [x for x in ranks if x.error is not None]
                if failed:
                    raise failed[0].error  # type: ignore[misc]
                if self.progress != before:
                    quiet.clear()
                    continue
                if not asleep:
                    quiet.add(t.token)
                awake = {x.token for x in alive if x.wake_at <= self.step}
                if not awake <= quiet:
                    continue
                # Every awake thread had its turn and nothing moved: let time pass to the
                # next due operation or waking thread, or report the deadlock (after a last
                # turn of the devices: work queued since their last turn may run now).
                if [dev for dev in self.devices if dev.advance()]:
                    quiet.clear()
                    continue
                due = [op.ready_at for op in self._pending if op.ready_at is not None]
                due += [d for dev in self.devices for d in dev.due()]
                due += self._deadlines()
                due += [at for at, _, _ in self._notices]
                if any(d <= self.step for d in due) and retried != self.step:
                    retried = self.step  # due now, but every poll came before: once more
                    quiet.clear()
                    continue
                due += [x.wake_at for x in alive if x.wake_at > self.step]
                later = [d for d in due if d > self.step]
                if later:
                    self.step = min(later)
                    quiet.clear()
                    continue
                raise SimDeadlock(self.report())
            if self.mismatch is not None:
                raise SimMismatch(self.mismatch)
        finally:
            self._abort()
        return [t.result for t in ranks]

    def _deadlines(self) -> list[int]:
        """Steps at which an engine has something due that no poll finds by itself (a
        deferred agreement round, a timeout: `Engine.deadlines`), one step past each."""
        return [int(t / STEP_SECONDS) + 1 for runtime in self.runtimes
                for t in runtime.engine.deadlines()]

    def _abort(self) -> None:
        """Unwind every thread still parked (workers, deadlocked ranks), until each has
        ended: a rank's asyncio loop may park again in another task after one is unwound,
        and the program's own ``finally`` blocks must run (a recording saves there)."""
        self._aborted = True
        for _ in range(10_000):
            live = [t for t in self._threads if not t.finished]
            if not live:
                return
            for t in live:
                self._resume(t)

    def report(self) -> str:
        """What every rank waits for: its engine's flight record and the missing peers."""
        lines = [f"simulated world of {self.size} (seed {self.seed}) at step {self.step}"]
        for rank, runtime in enumerate(self.runtimes):
            lines.append(f"rank {rank}:")
            lines.extend("  " + line for line in flight_record(runtime.engine).splitlines()[1:])
            if self.devices:
                lines.extend("  " + line for line in self.devices[rank].describe())
        stuck = [op for op in self._pending if not op.executed]
        if stuck:
            lines.append("operations not finished:")
            lines.extend(f"  {op.describe()}" for op in stuck)
        return "\n".join(lines)

    # -- faults ---------------------------------------------------------------------------

    def inject(self, kind: str, objects: list[Any]) -> None:
        """Make the next operation started on any of ``objects`` (a rank's buffers) fail on
        that rank: ``"start"`` (its start raises) or ``"error"`` (it runs, then its backend
        reports a failure there)."""
        for obj in objects:
            self._faults[id(obj)] = (kind, obj)  # the object kept: its id stays its own

    def mirror(self, host: Any, device: Any) -> None:
        """``host`` is the host copy of the device array ``device`` for a staged operation:
        a fault injected on ``device`` fires on the host call made on ``host``."""
        self._mirrors[id(host)] = (host, device)

    def fault(self, args: tuple[Any, ...]) -> str | None:
        """The fault injected on a buffer among ``args`` (used once), if any; on a fusion
        buffer, one injected on any buffer it carries (its members' operations run as it)."""
        for arg in args:
            if isinstance(arg, Buffer):
                mirrored = self._mirrors.get(id(arg.obj))
                obj = arg.obj if mirrored is None else mirrored[1]
                for one in (obj, *carried(obj)):
                    entry = self._faults.pop(id(one), None)
                    if entry is not None:
                        return entry[0]
        return None

    # -- matching (called by SimBackend, from the thread holding the baton) ---------------

    def arrive(self, backend: SimBackend, group: SimGroup, kind: str,
               signature: tuple[Any, ...], args: tuple[Any, ...]) -> SimOp:
        rank = backend.world_rank
        key = (backend.name, group.gid)
        ckey = (backend.name, group.gid, rank)
        index = self._coll_count.get(ckey, 0)
        self._coll_count[ckey] = index + 1
        ops = self._colls.setdefault(key, [])
        if index == len(ops):
            op = SimOp(kind, group.gid, backend.name, index, (kind, *signature), group.members)
            ops.append(op)
            self._pending.append(op)
        op = ops[index]
        if op.signature != (kind, *signature) and self.mismatch is None:
            first = next(iter(op.args), None)
            self.mismatch = (
                f"{backend.name}:{group.gid} collective #{index}: rank {first} issued "
                f"{op.signature}, rank {rank} issued {(kind, *signature)}"
            )
        op.args[rank] = args
        self._on_stream(backend, group, rank, op)
        self.progress += 1
        return op

    def arrive_p2p(self, backend: SimBackend, group: SimGroup, side: str, peer: int, tag: int,
                   buf: Any) -> SimOp:
        rank = backend.world_rank
        src, dst = (rank, peer) if side == "send" else (peer, rank)
        key = (backend.name, group.gid, src, dst, tag)
        ckey = (*key, side)
        index = self._p2p_count.get(ckey, 0)
        self._p2p_count[ckey] = index + 1
        ops = self._p2p.setdefault(key, [])
        if index == len(ops):
            op = SimOp("p2p", group.gid, backend.name, index,
                       ("p2p", buf.dtype.value, buf.nbytes), (src, dst))
            op.tag = tag
            ops.append(op)
            self._pending.append(op)
        op = ops[index]
        if op.signature != ("p2p", buf.dtype.value, buf.nbytes) and self.mismatch is None:
            self.mismatch = (f"{backend.name}:{group.gid} message #{index} from {src} to {dst} "
                             f"tag {tag}: {op.signature} sent, {buf.dtype.value} "
                             f"{buf.nbytes} B expected")
        op.args[rank] = (buf,)
        self._on_stream(backend, group, rank, op)
        self.progress += 1
        return op

    def _on_stream(self, backend: SimBackend, group: SimGroup, rank: int, op: SimOp) -> None:
        if backend.semantics != "nccl":
            return
        skey = (rank, backend.name) if self.stream == "backend" else (rank, backend.name,
                                                                       group.gid)
        stream = self._streams.setdefault(skey, [])
        op.seqs[rank] = len(stream)
        stream.append(op)

    def _stream_clear(self, op: SimOp) -> bool:
        """For nccl semantics: every member's stream has finished what it issued before op."""
        for rank, pos in op.seqs.items():
            backend = self.backends[op.backend]
            if backend != "nccl":
                return True
            skey = (rank, op.backend) if self.stream == "backend" else (rank, op.backend, op.gid)
            stream = self._streams[skey]
            if not all(prev.executed for prev in stream[:pos]):
                return False
        return True

    def try_execute(self, op: SimOp) -> bool:
        """Execute ``op`` if it is due; True once it has executed."""
        if op.executed:
            return True
        if len(op.args) < len(op.members) or self.mismatch is not None:
            return False  # (a mismatched world stops moving data: run() reports it)
        if op.ready_at is None:
            if op.on_streams and len(op.heads) < len(op.members):
                return False  # a member's stream has not reached it yet
            if not self._stream_clear(op):
                return False
            op.ready_at = self.step + int(self.rng.integers(self.max_delay + 1))
            self.progress += 1
        if self.step < op.ready_at:
            return False
        unfit = _unfit(op)
        if unfit is not None:  # (what a real backend would fail on, or abort the process)
            self.mismatch = unfit
            return False
        _execute(op)
        op.executed = True
        self._pending.remove(op)
        self.progress += 1
        return True

    def block_until_executed(self, op: SimOp, rank: int) -> None:
        """A blocking simulated call: hand the baton on until ``op`` has executed."""
        while not self.try_execute(op):
            self.yield_()


def _unblocked(caps: Any) -> Any:
    return replace(caps, blocking_calls=False)


def _loop_has_other_work() -> bool:
    """Whether the calling task's event loop (if it awaits in an engine's driver) has a
    callback ready that is not another task awaiting in one (those poll, which moves
    nothing by itself). Reads asyncio's ready queue (``_ready``); a loop without one (not
    asyncio's own) says nothing."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not _DRIVE_CODE:
        frame = frame.f_back
    if frame is None:  # a blocking wait inside a task: its loop cannot run meanwhile
        return False
    for handle in getattr(loop, "_ready", ()):
        owner = getattr(getattr(handle, "_callback", None), "__self__", None)
        if not isinstance(owner, asyncio.Task) or not _driving(owner):
            return True
    return False


def _driving(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is suspended in (or running) an engine driver's ``await``."""
    awaited: Any = task.get_coro()
    while awaited is not None:
        if getattr(awaited, "gi_code", None) is _DRIVE_CODE:
            return True
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return False


def _np(buf: Any) -> np.ndarray:
    return np.asarray(buf.numpy()).reshape(-1)


def _unfit(op: SimOp) -> str | None:
    """Why the members' buffers of ``op`` do not fit one another, if they do not: an
    alltoallv whose sender sends a member other counts than that member expects."""
    if op.kind != "alltoallv":
        return None
    members, args = op.members, op.args
    for i, src in enumerate(members):
        for j, dst in enumerate(members):
            sent, expected = args[src][1][j], args[dst][3][i]
            if sent != expected:
                return (f"{op.backend}:{op.gid} alltoallv #{op.index}: rank {src} sends "
                        f"{sent} rows to rank {dst}, which expects {expected} from it "
                        f"(recv_counts); members must agree on every count")
    return None


def _execute(op: SimOp) -> None:
    """Move ``op``'s data: inputs are read now, outputs written now."""
    members = op.members
    args = op.args
    kind = op.kind
    if kind == "p2p":
        src, dst = members
        _np(args[dst][0])[:] = _np(args[src][0])
        return
    n = len(members)
    if kind == "barrier":
        return
    if kind in ("allreduce", "reduce"):
        red = args[members[0]][-1]
        result = reduce_stack(np.stack([_np(args[m][0]) for m in members]), red)
        if kind == "allreduce":
            for m in members:
                _np(args[m][0])[:] = result
        else:
            root = members[args[members[0]][1]]
            _np(args[root][0])[:] = result
        return
    if kind == "broadcast":
        root = members[args[members[0]][1]]
        value = _np(args[root][0]).copy()
        for m in members:
            _np(args[m][0])[:] = value
        return
    if kind in ("allgather", "gather"):
        whole = np.concatenate([_np(args[m][0]) for m in members])
        if kind == "allgather":
            for m in members:
                _np(args[m][1])[:] = whole
        else:
            root = members[args[members[0]][2]]
            _np(args[root][1])[:] = whole
        return
    if kind == "scatter":
        root = members[args[members[0]][2]]
        chunks = np.split(_np(args[root][0]), n)
        for i, m in enumerate(members):
            _np(args[m][1])[:] = chunks[i]
        return
    if kind == "reduce_scatter":
        red = args[members[0]][2]
        chunks = np.split(reduce_stack(np.stack([_np(args[m][0]) for m in members]), red), n)
        for i, m in enumerate(members):
            _np(args[m][1])[:] = chunks[i]
        return
    if kind == "alltoall":
        parts = [np.split(_np(args[m][0]), n) for m in members]
        for j, m in enumerate(members):
            _np(args[m][1])[:] = np.concatenate([parts[i][j] for i in range(n)])
        return
    if kind == "alltoallv":
        sends = {}
        for m in members:
            buf, send_counts = args[m][0], args[m][1]
            row = buf.row_elems()
            flat = _np(buf)
            offs = np.cumsum([0, *send_counts])
            sends[m] = [flat[offs[j] * row:offs[j + 1] * row] for j in range(n)]
        for j, m in enumerate(members):
            out = _np(args[m][2])
            out[:] = np.concatenate([sends[i][j] for i in members]) if out.size else out
        return
    raise AssertionError(f"unknown simulated operation {kind}")
