"""The runtime: owns one engine, the backends it brought up, and the communicators made from them.

``init()`` makes one and returns its world communicator; ``finalize()`` drains and releases it
(`mcrdl.front._process`, which keeps the process to one live runtime at a time).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any


from ..backends import Backend
from ..backends._staging import StagedBackend
from ..backends._threaded import ThreadedBackend, Threads
from ..bootstrap._agree import Meeting
from ..bootstrap._launch import Bootstrap
from ..bootstrap._mesh import Mesh
from ..bootstrap._notices import Notices
from ..core._config import Config
from ..core._errors import (
    BackendError,
    BackendUnavailableError,
    MCRDLError,
    RuntimeFinalizedError,
)
from ..engine import CommFuture, CommState, Engine, PollPolicy
from ..engine._names import Names
from ..observe._flight import flight_dump, flight_record
from ..observe._recorder import Recorder, format_summary, summarize, trace_events
from ..tuning._table import TuningTable
from ._communicator import Communicator
from ._select import DEFAULT_PREFERENCE, Selector, Slot
from ._shrink import shrink
from ._taskcheck import TaskCheck

__all__ = ["Runtime"]

#: The live runtime (one at most: `mcrdl.front._process`).
_live: list[Runtime] = []
_live_lock = threading.RLock()  # init() finalizes a runtime it failed to agree on
#: Whether a runtime of this process finalized with operations failed (the exit handler
#: then bounds MPI_Finalize: `mcrdl.front._process`).
_unhealthy = False


class Runtime:
    """One ``init()``: the engine, the backends, the world communicator.

    Invariants:
    - every backend in ``_backends`` is up on the world; each communicator has a group on each,
      but a shrunk one on those that could make one once members were gone.
    - after ``finalize()`` nothing can be submitted, and no future is left unfinished.
    """

    def __init__(
        self,
        config: Config,
        bootstrap: Bootstrap | None,
        backends: Mapping[str, Backend],
        *,
        engine: Engine | None = None,
        threads: Threads | None = None,
        selector: Selector | None = None,
        notices: Any = None,
        meeting: Meeting | None = None,
        staging: Callable[[Backend, Mapping[str, Any]], Backend] = StagedBackend,
    ) -> None:
        if not backends:
            raise BackendUnavailableError("no backend could be brought up")
        self.config = config
        self.bootstrap = bootstrap
        # The engine never blocks in a backend: blocking ones get a thread per lane.
        self._backends = {
            # (its start_* methods are generated, which mypy cannot see)
            name: ThreadedBackend(b, threads)  # type: ignore[abstract]
            if b.capabilities.blocking_calls else b
            for name, b in backends.items()
        }
        if not any("cpu" in b.capabilities.devices for b in backends.values()):
            raise BackendUnavailableError(
                f"backends {', '.join(sorted(backends))} reach device memory only; mcrdl "
                "needs one that reaches host memory too (mpi or gloo) for its own exchanges "
                "(named operations' agreement, debug mode's checks)"
            )
        self.finalized = False
        #: The devices the backends reach, by name (`mcrdl.backends.Device`).
        self.devices: dict[str, Any] = {b.device.name: b.device for b in backends.values()
                                        if b.device is not None}
        if bootstrap is not None:
            self.devices.update(_cuda_devices(self.devices))
        if self.devices:  # host backends reach them through host copies where they cannot
            kinds = {d.kind for d in self.devices.values()}
            self._backends = {
                name: staging(b, self.devices)
                if not b.capabilities.stream_ordered and kinds - b.capabilities.devices else b
                for name, b in self._backends.items()
            }
        self.engine = engine or Engine(
            policy=_poll_policy(bootstrap),
            background=config.progress_thread,
            timeout=config.timeout,
            on_timeout=self._on_timeout,
        )
        self.tuning: TuningTable | None = None
        self._tuning_error: str | None = None
        if config.tuning and selector is None:
            try:
                self.tuning = TuningTable.load(config.tuning)
            except ValueError as exc:  # every rank must still reach the agreement exchange
                self._tuning_error = str(exc)
        self.selector = selector or Selector(tuple(backends), table=self.tuning)
        #: A connection to every peer, where the store lives in a rank: who died, and the
        #: survivors' agreement (`mcrdl.bootstrap._mesh`; None: a launcher's store).
        self.mesh: Mesh | None = None
        if bootstrap is not None and bootstrap.size > 1 and bootstrap.store_host is not None:
            self.mesh = Mesh(bootstrap, config.peer_timeout, self.engine.learn_lost)
        self.engine.on_fault = self._on_fault
        self.engine.on_heard = self._on_heard
        if "torch" in sys.modules:  # (every backend here loads it; a numpy-only world has none)
            import torch.autograd.profiler

            self.engine.torch_profiler = torch.autograd.profiler
        _watch_dump_signals(self, bootstrap)
        #: Tells peers of broken communicators and listens for theirs (None: no peers, or
        #: a simulated world's own).
        self.notices = notices
        if notices is None and bootstrap is not None and bootstrap.size > 1:
            self.notices = Notices(bootstrap.store(), bootstrap.rank, self.engine,
                                   bootstrap.store_host)
        self._comms: list[Communicator] = []
        self.shrinks: dict[str, int] = {}  #: times each communicator was shrunk
        self._meeting = meeting
        #: The survivors' store, where a shrink replaced the bootstrap's (None: it did not).
        self._store: Any = None
        #: The task check every communicator calls after a submission (None: off).
        self.task_check = TaskCheck() if config.check_tasks else None
        worlds = {name: b.world() for name, b in self._backends.items()}
        size = next(iter(worlds.values())).size
        extra = self._extra_groups(worlds, list(range(size)), "world")
        self.world = self._communicator("world", worlds, *extra, tuple(range(size)))
        #: The comms log and trace (`mcrdl.observe._recorder`), while either is on.
        self.recorder: Recorder | None = None
        if config.log or config.trace:
            self.recorder = Recorder(self.engine, self.world.rank, size)
            if config.trace and bootstrap is not None and size > 1:
                self.recorder.align(bootstrap.store(), bootstrap.timeout)

    # -- the comms log and trace -----------------------------------------------------------

    def _gather(self, comm: Communicator, payload: Any, everyone: bool) -> list[Any] | None:
        """Every member's ``payload`` through the bootstrap store (see Recorder.gather), in
        ``comm``'s rank order; the members known gone take no part (their entries None, and
        the lowest live member stands for member 0), rather than be waited for."""
        rec = self.recorder
        if rec is None or comm.size == 1 or self.bootstrap is None:
            return [payload]
        live = [m for m in comm.members if m not in self.engine.gone]
        got = rec.gather(self.store(), live, live.index(comm.members[comm.rank]),
                         payload, min(self.config.timeout or 60.0, 60.0), everyone)
        if got is None:
            return None
        by_rank = dict(zip(live, got, strict=True))
        return [by_rank.get(m) for m in comm.members]

    def log_records(self) -> list[dict[str, Any]]:
        """This rank's comms log (`Recorder.records`); MCRDLError while it is off."""
        if self.recorder is None:
            raise MCRDLError("the comms log is off: pass init(log=True) or set MCRDL_LOG=1")
        return self.recorder.records()

    def log_summary(self, comm: Communicator, everyone: bool = True) -> str | None:
        """The comms log's summary over ``comm``'s members (collective over them): this
        runtime's operations on every communicator, per (op, backend, size bucket)."""
        gathered = self._gather(comm, self.log_records(), everyone)
        if gathered is None:
            return None
        text = format_summary(summarize([g for g in gathered if g is not None]))
        missing = [comm.members[i] for i, g in enumerate(gathered) if g is None]
        if missing:
            text += f"\n(ranks {missing} did not report within the timeout)"
        return text

    def _report(self) -> None:
        """At finalize: the log's summary (printed on rank 0) and the trace (written by
        rank 0), each gathered over the world."""
        rec = self.recorder
        if rec is None:
            return
        if self.config.log:
            text = self.log_summary(self.world, everyone=False)
            if text is not None:
                print(text, flush=True)
        if self.config.trace:
            payload = {"records": rec.records(), "edges": rec.edges(), "spans": rec.spans,
                       "offset": rec.offset, "skew_bound": rec.skew_bound, "t0": rec.t0}
            gathered = self._gather(self.world, payload, False)
            if gathered is None:
                return
            here = [g for g in gathered if g is not None]
            doc = {"traceEvents": trace_events(gathered, here[0]["t0"] if here else 0.0),
                   "displayTimeUnit": "ms",
                   "otherData": {"mcrdl": "trace", "ranks": len(gathered),
                                 "clock_skew_bound_us": [
                                     None if g is None else round(g["skew_bound"] * 1e6, 1)
                                     for g in gathered]}}
            with open(self.config.trace, "w", encoding="utf-8") as fh:
                json.dump(doc, fh)

    def backend(self, name: str) -> Backend:
        """The backend object ``name`` (for benchmarks and tools; users pass names)."""
        try:
            return self._backends[name]
        except KeyError:
            raise BackendUnavailableError(
                f"backend {name!r} is not up in this runtime; up: {', '.join(self._backends)}"
            ) from None

    def _extra_groups(self, parents: dict[str, Any], members: list[int], name: str,
                      store: Any = None) -> tuple[dict[str, Any], Any]:
        """The groups a communicator needs besides one per backend, made from ``parents``
        (the parent's groups, or the worlds, by backend) in name order: one more per backend
        for named operations (rule 8: they never share positions with unnamed ones), and
        debug mode's group for fingerprints. ``store``: see `make_groups`."""
        named = {bname: self._group(bname, parents[bname], members, f"{name}#named", store)
                 for bname in sorted(parents)}
        debug = None
        if self.config.debug:
            control = self.control_of(parents)
            debug = self._group(control, parents[control], members, f"{name}#debug", store)
        return named, debug

    def _group(self, bname: str, parent: Any, members: Sequence[int], tag: str,
               store: Any) -> Any:
        backend = self._backends[bname]
        if store is None:
            return backend.create_group(parent, members, tag)
        if backend.capabilities.self_progressing:
            # (Never under the lock: this creation may wait for a member that is gone, and
            # the shrink's watcher takes the lock to learn of deaths.)
            return backend.regroup(parent, members, tag, store)
        with self.engine.lock:  # (MPI's calls are serialized by the engine's lock)
            return backend.regroup(parent, members, tag, store)

    def _communicator(self, name: str, groups: dict[str, Any], named_groups: dict[str, Any],
                      debug_group: Any, members: tuple[int, ...]) -> Communicator:
        """The communicator ``name`` over ``groups`` (one per backend) and ``named_groups``
        (the same for named operations); ``members`` are its world ranks, in its rank
        order."""
        first = next(iter(groups.values()))
        engine = self.engine
        state = engine.comm(name, first.rank, first.size, members)
        slots = {}
        named = {}
        control = self.control_of(groups)
        for bname in [b for b in self.selector.preference if b in groups]:
            backend = self._backends[bname]
            group = groups[bname]
            slots[bname] = Slot(backend, group, engine.lane(backend, group, state))
            group = named_groups[bname]
            named[bname] = Slot(backend, group,
                                engine.lane(backend, group, state, "#named", named=True))
        state.names = Names(engine, state, named[control].lane, self.config.fusion_bytes)
        debug = None
        if debug_group is not None:
            backend = self._backends[control]
            debug = Slot(backend, debug_group,
                         engine.lane(backend, debug_group, state, "#debug"))
        comm = Communicator(self, name, slots, members, debug, named)
        self._comms.append(comm)
        return comm

    def control_of(self, backends: Iterable[str]) -> str:
        """The backend of the runtime's own exchanges (debug fingerprints, agreed totals) on
        a communicator of ``backends``: rank-invariant, the first of the built-in preference
        among them that reaches host memory, whatever the selector prefers."""
        names = sorted(n for n in backends  # (its exchanges are host arrays)
                       if "cpu" in self._backends[n].capabilities.devices)
        return next((n for n in DEFAULT_PREFERENCE if n in names), names[0])

    def make_communicator(
        self, parent: Communicator, name: str, members: Sequence[int]
    ) -> Communicator:
        """The sub-communicator ``name`` of ``members`` of ``parent`` (called by members only)."""
        # Group creation blocks among the members only, all of which are making this same
        # call right after the same allgather; holding the lock keeps MPI serialized.
        with self.engine.lock:
            groups = self.make_groups(parent, members, name)
        return self._communicator(name, *groups, tuple(parent.members[m] for m in members))

    def make_groups(self, parent: Communicator, members: Sequence[int], name: str,
                    store: Any = None, without: Collection[str] = ()
                    ) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """Every group a communicator ``name`` of ``members`` of ``parent`` needs: one per
        backend of ``parent`` but those ``without``, one per backend for named operations,
        debug mode's (or None). Backend by backend in name order (a selector's preference
        may differ between ranks). With a ``store``, by ``Backend.regroup`` through it:
        ``parent`` has members that are gone (`Communicator.shrink`)."""
        parents = {bname: slot.group for bname, slot in parent._slots.items()
                   if bname not in without}
        groups = {bname: self._group(bname, parents[bname], members, name, store)
                  for bname in sorted(parents)}
        return (groups, *self._extra_groups(parents, list(members), name, store))

    def store(self) -> Any:
        """The store every live rank reaches: the bootstrap's, or the survivors' once a
        shrink replaced it (under mpiexec, rank 0's process served the bootstrap's).

        Raises:
            BackendUnavailableError: this runtime has no launched job's store.
        """
        if self._store is not None:
            return self._store
        if self.bootstrap is None:
            raise BackendUnavailableError("this runtime has no launched job's store")
        return self.bootstrap.store()

    def shrink_communicator(self, comm: Communicator) -> Communicator:
        """See `Communicator.shrink`."""
        name, groups, members = shrink(self, comm)
        return self._communicator(name, *groups, members)

    def close_communicator(self, comm: Communicator) -> None:
        """Wait for ``comm``'s unfinished operations, then free its groups."""
        lanes = {slot.lane for slot in comm.slots()}
        for fut in self.engine.unfinished():
            if fut.lane in lanes:
                try:
                    fut.wait()
                except Exception:  # noqa: BLE001 - its owner sees the error; we only drain
                    pass
        self._keep(comm)
        with self.engine.lock:
            refused = self._free_groups(comm)
        for state in {slot.lane.comm for slot in comm.slots()}:
            self.engine.forget(state)
        self._comms.remove(comm)
        if refused:
            raise refused[0]

    @staticmethod
    def _free_groups(comm: Communicator, world: bool = False) -> list[BackendError]:
        """Free each backend's group of ``comm`` (the engine's lock held; for the ``world``
        communicator, all but the backends' own world groups, which go with the backends);
        a backend that refuses (MPI, with messages no receive matched) does not stop the
        others: its refusals come back, naming the communicator."""
        refused = []
        for slot in comm.slots():
            if world and slot.group is slot.backend.world():
                continue
            try:
                slot.backend.free_group(slot.group)
            except BackendError as exc:
                refused.append(BackendError(f"closing communicator {comm.name}: {exc}"))
        return refused

    def _keep(self, comm: Communicator) -> None:
        """Before ``comm``'s groups go: let each backend keep those that peers may still be
        waiting on. A broken communicator's groups, all of them: a peer that has not yet
        heard of the break would otherwise see its operation fail with a closed connection
        instead of the cause. Otherwise those with zombies (destroying a gloo group joins
        its threads, which wait in the abandoned collective until gloo's own timeout)."""
        zombies = self.engine.zombies()
        broken = any(slot.lane.comm.broken is not None for slot in comm.slots())
        if not broken and not zombies:
            return
        with self.engine.lock:
            for slot in comm.slots():
                if broken or any(fut.lane is slot.lane for fut in zombies):
                    slot.backend.abandon(slot.group)

    def _on_timeout(self, expired: list[CommFuture]) -> Callable[[], None]:
        """The engine's hook on a timeout (its lock held, the expired operations not yet given
        up): the flight recorder as it stands, written to the configured destination once the
        lock is released."""
        record = flight_record(self.engine)
        dump = flight_dump(self.engine, list(self.engine.waiting))
        reason = (f"{len(expired)} operation(s) timed out: "
                  f"{', '.join(repr(f) for f in expired)}")
        return lambda: self.dump_flight_recorder(reason=reason, text=record, dump=dump)

    def _on_fault(self, fut: CommFuture) -> None:
        self.dump_flight_recorder(reason=f"{fut!r} failed: {fut._error}")

    def _on_heard(self, comm: CommState, cause: str, peer: int) -> Callable[[], None] | None:
        """The engine's hook when a peer broke ``comm`` (its lock held, nothing failed here
        for it yet): where this rank has operations unfinished there, which the break is
        about to fail, the flight recorder as it stands, written once the lock is released.
        So every rank a break reaches dumps what it was waiting for; one with nothing there
        (its own timeout failed it, and dumped, first) keeps its earlier dump the last."""
        if not any(f.lane.comm is comm for f in self.engine.unfinished_locked()):
            return None
        record = flight_record(self.engine)
        dump = flight_dump(self.engine, list(self.engine.waiting))
        reason = f"communicator {comm.name} broken by rank {peer}: {cause}"
        return lambda: self.dump_flight_recorder(reason=reason, text=record, dump=dump)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A signal handler runs between bytecodes of the main thread, which may hold the
        # engine's lock: the dump is taken by a thread of its own.
        threading.Thread(target=self.dump_flight_recorder,
                         kwargs={"reason": f"signal {signal.Signals(signum).name}"},
                         name="mcrdl-flight-recorder", daemon=True).start()

    def dump_flight_recorder(self, path: str | None = None, *, reason: str = "on request",
                             text: str | None = None, dump: dict[str, Any] | None = None
                             ) -> None:
        """Write the flight recorder: to ``path`` (or the configured destination) as one
        JSON line (machine-readable: ``python -m mcrdl trace explain`` reads the dumps of all
        ranks) when it ends in ``.json``, as text otherwise (``stderr``: to stderr)."""
        dest = path or self.config.flight_recorder
        rank = self.world.rank
        try:
            if dest.endswith(".json"):
                if dump is None:
                    with self.engine.lock:
                        dump = flight_dump(self.engine, list(self.engine.waiting))
                doc = {"rank": rank, "size": self.world.size, "reason": reason,
                       "time": time.time(), **dump}
                line = json.dumps(doc) + "\n"
                with open(dest.replace("{rank}", str(rank)), "a", encoding="utf-8") as fh:
                    fh.write(line)
                return
            body = f"mcrdl: flight recorder on rank {rank}, {reason}\n"
            if text is None:
                with self.engine.lock:
                    text = flight_record(self.engine)
            body += text + "\n"
            if dest == "stderr":
                sys.stderr.write(body)
                sys.stderr.flush()
            else:
                with open(dest.replace("{rank}", str(rank)), "a", encoding="utf-8") as fh:
                    fh.write(body)
        except OSError:  # a launcher that stopped reading our stderr must not hide the error
            pass

    def finalize(self) -> None:
        """Wait for every submitted operation, then release backends. Idempotent.

        Operations that cannot finish within the runtime's timeout fail with
        CommTimeoutError first; anything still unfinished after that fails with
        RuntimeFinalizedError.
        """
        if self.finalized:
            return
        engine = self.engine
        for fut in engine.unfinished():
            try:
                fut.wait()
            except Exception:  # noqa: BLE001 - the future carries its error; finalize goes on
                pass
        engine.fail_all(
            lambda f: RuntimeFinalizedError(f"the runtime was finalized before {f!r} finished")
        )
        try:
            self._report()
        except Exception as exc:  # noqa: BLE001 - a report must not stop the finalization
            sys.stderr.write(f"mcrdl: the comms log or trace could not be written: {exc}\n")
        if self.notices is not None:
            self.notices.close()
        if self.mesh is not None:
            self.mesh.close()
        stats = engine.stats()
        if stats.failed:
            global _unhealthy
            _unhealthy = True
        self.finalized = True
        for comm in self._comms:
            self._keep(comm)
        engine.close("finalize() was called")
        with engine.lock:
            refused = []
            for comm in list(self._comms):
                comm._mark_closed()
                refused += self._free_groups(comm, world=comm is self.world)
            for backend in self._backends.values():
                try:
                    backend.close()
                except BackendError as exc:
                    refused.append(BackendError(f"closing communicator world: {exc}"))
        for error in refused:  # reported, and finalize goes on: MPI_Finalize still has to run
            sys.stderr.write(f"mcrdl: {error}\n")
        if self.bootstrap is not None:
            self.bootstrap.close()
        with _live_lock:
            if self in _live:
                _live.remove(self)


def _watch_dump_signals(runtime: Runtime, bootstrap: Bootstrap | None) -> None:
    """SIGUSR2 dumps the flight recorder; so does SIGUSR1 where no MPI launcher started
    this process (under one, SIGUSR1 is hydra's "a peer died", which is ignored: the mesh
    tells who). Handlers the program installed itself are left alone; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    sigs = [signal.SIGUSR2]
    if bootstrap is None or bootstrap.launcher != "mpi":
        sigs.append(signal.SIGUSR1)
    for sig in sigs:
        current = signal.getsignal(sig)
        if current is signal.SIG_DFL or getattr(current, "__func__", None) is Runtime._on_signal:
            signal.signal(sig, runtime._on_signal)


def _cuda_devices(known: Mapping[str, Any]) -> dict[str, Any]:
    """This process's current GPU, where torch is loaded and sees one and no backend brought
    it up already (then MPI and gloo reach it staged: ``backends._staging``)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    index = torch.cuda.current_device()
    if f"cuda:{index}" in known:
        return {}
    from ..backends._cuda import CudaDevice

    return {f"cuda:{index}": CudaDevice(index)}


#: The background thread's longest nap where the ranks fill the cores, one a core
#: (docs/performance-log.md, "The progress thread naps longer where the ranks fill the cores").
_FULL_NODE_NAP = 4e-3


def _poll_policy(bootstrap: Bootstrap | None) -> PollPolicy:
    """How the engine idles on this host, from its ranks against its cores:
    - more ranks than cores (``oversubscribed``): waiters never spin;
    - as many (one rank a core): the background thread naps up to 4 ms while it finds
      nothing to poll (`PollPolicy.background_nap_max`), since it has no core of its own.
      Not where there are more ranks than cores: there the peers wait on a rank's polls
      while it computes, and 4 ms naps made the examples' steps longer
      (docs/performance-log.md, "The progress thread naps longer where the ranks fill the
      cores")."""
    if bootstrap is None:
        return PollPolicy()
    cores = os.cpu_count() or 1
    return PollPolicy(oversubscribed=bootstrap.local_size > cores,
                      background_nap_max=_FULL_NODE_NAP if bootstrap.local_size == cores
                      else None)
