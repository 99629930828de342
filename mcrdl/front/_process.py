"""The process's runtime: ``init()`` brings one up and returns its world communicator,
``finalize()`` drains and releases it, and an exit handler finalizes what the program left
live. A process has at most one live runtime at a time (MPI and the launcher's store are
per-process resources); after ``finalize()`` a new ``init()`` may start another.
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..backends import Backend, backend_class, known_backends
from ..bootstrap._launch import Bootstrap, finalize_mpi, mpi_up
from ..core._config import Config
from ..core._errors import BackendUnavailableError, MCRDLError
from ..core._versions import check_torch
from ..engine._breaks import linger
from . import _runtime
from ._communicator import Communicator
from ._runtime import Runtime, _live, _live_lock
from ._settings import agree_on_settings

__all__ = ["current_runtime", "finalize", "init", "span"]

_atexit_registered = False

#: Backends a launcher can bring up by default, in bring-up order.
_DEFAULTS = {"mpi": ("mpi", "gloo"), "single": ("mpi", "gloo"), "torchrun": ("gloo",),
             "store": ("gloo",)}


def init(
    *,
    backends: Sequence[str] | str | None = None,
    timeout: float | None | str = "unset",
    debug: bool | None = None,
    check_tasks: bool | None = None,
    tuning: str | None = None,
    progress_thread: bool | None = None,
    flight_recorder: str | None = None,
    host: str | None = None,
    log: bool | None = None,
    trace: str | None = None,
    fusion_bytes: int | None = None,
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Communicator:
    """Bring up every available backend and return the world communicator.

    Works under ``mpiexec``/``srun`` (MPI and gloo, gloo bootstrapped through MPI), under
    ``torchrun`` (gloo only) and in a plain process (a world of one). Arguments override the
    ``MCRDL_*`` environment variables (see ``mcrdl.core._config``).

    Args:
        backends: names to bring up (default: all that can run under this launcher).
        timeout: seconds an issued operation may take before it fails with
            CommTimeoutError; None for no limit.
        debug: check every collective's fingerprint across its group.
        check_tasks: warn (`TaskOrderWarning`) when two asyncio tasks have unnamed
            collectives unfinished on one communicator at once (`mcrdl.front._taskcheck`):
            a cheap local check of the rule that debug mode checks across the ranks.
        tuning: a tuning table for ``backend="auto"``.
        progress_thread: run the background progress thread (default True).
        flight_recorder: where timeouts dump the flight recorder (``"stderr"`` or a path;
            ``{rank}`` in a path is replaced by the rank).
        host: this host's interface name (the same on every host) or its own address, to
            bind and advertise instead of the one found (docs/hosts.md).
        log: record every operation (`mcrdl.observe._recorder`): ``comm.log_summary()``, and a
            summary printed by rank 0 at ``finalize()``.
        trace: write a timeline of every rank's operations here at ``finalize()``
            (trace-event JSON for ui.perfetto.dev; rank 0 writes it).
        fusion_bytes: the most bytes one fused allreduce carries: small named allreduces
            agreed in one round run as one (`mcrdl.engine._fusion`); 0 turns fusion off.
            Every rank must pass the same (init() checks).
        store: bring the world up from this torch.distributed store, shared by
            ``world_size`` processes, as torch's own ``init_process_group(store=...)`` does,
            instead of from the launcher: gloo only.
        rank: this process's rank in the store's world (with ``store``).
        world_size: how many processes share the store (with ``store``).

    Raises:
        MCRDLError: a runtime is live already (use its communicator, or finalize first).
        UnknownBackendError, BackendUnavailableError: a requested backend cannot come up.
    """
    global _atexit_registered
    with _live_lock:
        if _live:
            raise MCRDLError(
                "mcrdl is initialized already; use the communicator init() returned, "
                "or call mcrdl.finalize() first"
            )
        check_torch()
        config = Config.load(backends=backends, timeout=timeout, debug=debug,
                             check_tasks=check_tasks, tuning=tuning,
                             progress_thread=progress_thread, flight_recorder=flight_recorder,
                             host=host, log=log, trace=trace, fusion_bytes=fusion_bytes)
        given = None
        if store is not None or rank is not None or world_size is not None:
            if store is None or rank is None or world_size is None:
                raise ValueError(f"init(store=, rank=, world_size=) go together; got store="
                                 f"{store!r}, rank={rank!r}, world_size={world_size!r}")
            if not 0 <= rank < world_size:
                raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
            given = (store, rank, world_size)
        bootstrap = Bootstrap(config, given=given)
        names = config.backends or _DEFAULTS[bootstrap.launcher]
        up: dict[str, Backend] = {}
        for name in names:
            cls = backend_class(name)  # UnknownBackendError for a typo
            if not cls.is_available():
                if config.backends is None:
                    continue
                raise BackendUnavailableError(
                    f"backend {name!r} cannot run here; known: {', '.join(known_backends())}"
                )
            up[name] = cls(bootstrap)
        runtime = Runtime(config, bootstrap, up)
        if config.tuning or bootstrap.size > 1:
            try:
                agree_on_settings(runtime)
            except MCRDLError:
                runtime.finalize()
                raise
        _live.append(runtime)
        if not _atexit_registered:
            atexit.register(_finalize_at_exit)
            _atexit_registered = True
    return runtime.world


def current_runtime() -> Runtime | None:
    """The live runtime, if ``init()`` was called and not finalized."""
    return _live[0] if _live else None


@contextmanager
def span(name: str) -> Iterator[None]:
    """``with mcrdl.span("forward"):`` marks a region of the program on the timeline (a track
    of its own per rank, beside the lanes). Costs two clock reads; nothing when no trace or
    log is being recorded."""
    runtime = current_runtime()
    recorder = runtime.recorder if runtime is not None else None
    if recorder is None:
        yield
        return
    with recorder.span(name):
        yield


def finalize() -> None:
    """Finalize the live runtime (see `Runtime.finalize`); a no-op when there is none."""
    runtime = current_runtime()
    if runtime is not None:
        runtime.finalize()


#: Seconds MPI_Finalize may take at exit after operations failed before the process is ended.
EXIT_GRACE = 5


def _finalize_at_exit() -> None:
    # A program ended by an exception it did not catch is a failed rank: its peers learn it
    # is gone (no goodbye on the mesh) rather than wait for it until their timeout.
    crashed = getattr(sys, "last_value", None) is not None
    for runtime in list(_live):
        if crashed and runtime.mesh is not None:
            runtime.mesh.close(goodbye=False)
        try:
            runtime.finalize()
        except Exception as exc:  # noqa: BLE001 - report, but let the interpreter exit
            sys.stderr.write(f"mcrdl: finalize at exit failed: {exc}\n")
    main = threading.current_thread() is threading.main_thread()
    mpi = mpi_up()
    # (a process alone in its MPI world has nobody that MPI_Finalize could wait for)
    if _runtime._unhealthy and main and mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        # After failures (a dead peer, a timeout, a host cut off) MPI_Finalize, which runs
        # after this, can wait forever in the launcher for a process that never comes. An
        # alarm whose default action ends the process bounds it: a watchdog thread cannot,
        # since MPI_Finalize holds the GIL (and mpi4py's own runs after the interpreter has
        # stopped every thread). `finalize_mpi` disarms it once MPI_Finalize returned.
        sys.stderr.write(f"mcrdl: operations failed; MPI_Finalize has {EXIT_GRACE} s before"
                         " this process is ended (SIGALRM)\n")
        sys.stderr.flush()
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(EXIT_GRACE)
    # No thread may wake inside a backend while the interpreter finalizes.
    linger(before=finalize_mpi)
