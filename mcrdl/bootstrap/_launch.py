"""Bootstrap: which launcher started this process, who we are, and a store for the backends.

- ``mpiexec``/``srun`` (PMI or OpenMPI variables present): MPI is initialized here, at thread
  level SERIALIZED (all MPI calls go through the engine's lock; MULTIPLE makes a small call
  markedly dearer: docs/performance.md, "Symptom -> setting"), and the store for gloo is
  bootstrapped through MPI: rank 0 serves it on the address every rank agreed on
  (`_netaddr`: loopback where all ranks share a network, otherwise the first of rank 0's
  addresses that every rank reached) and broadcasts the port. No MASTER_ADDR/MASTER_PORT
  needed.
- ``torchrun`` (``TORCHELASTIC_RUN_ID``, or ``RANK``/``WORLD_SIZE``): no MPI; the store is the
  launcher's rendezvous (``env://``); across hosts each rank binds the address its route to
  ``MASTER_ADDR`` leaves from.
- a store given to ``init(store=, rank=, world_size=)`` (``"store"``: torch.distributed started
  first, e.g. ``dist.init_process_group("mcrdl", store=...)`` under torch's test harness): no
  MPI; rank 0 serves a TCPStore of mcrdl's own on the agreed host and publishes its address
  through the given store (mcrdl needs a store with queues, which a FileStore lacks).
- anything else: a world of one, with an in-process store.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any

from ..core._config import Config
from ..core._errors import BackendUnavailableError
from ._netaddr import (
    LOOPBACK,
    Listeners,
    describe_reach,
    family,
    local_addresses,
    net_identity,
    probe,
    resolve_host,
)

__all__ = ["Bootstrap", "detect_launcher", "finalize_mpi", "import_mpi", "mpi_up"]

_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
#: Seconds every rank tries to reach rank 0's addresses (a LAN handshake takes milliseconds).
_PROBE_SECONDS = 10.0
#: Runtimes brought up from a given store in this process (keys of each bring-up apart).
_generation = 0


def detect_launcher(environ: Mapping[str, str] | None = None) -> str:
    """``"mpi"``, ``"torchrun"`` or ``"single"``, from the launcher's environment variables."""
    env = os.environ if environ is None else environ
    if any(v in env for v in _MPI_VARS):
        return "mpi"
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return "torchrun"
    return "single"


def _route_to(env: Mapping[str, str]) -> str:
    """The local address a connection to torchrun's ``MASTER_ADDR`` would leave from."""
    master = env.get("MASTER_ADDR")
    if not master:
        return socket.gethostbyname(socket.gethostname())
    try:
        fam, _, _, _, where = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(where)  # a routing lookup: nothing is sent
            return str(s.getsockname()[0])
    except OSError as exc:
        raise BackendUnavailableError(
            f"no route from this host to MASTER_ADDR={master!r} ({exc}); set MCRDL_HOST"
            " to the interface that reaches it"
        ) from exc


def import_mpi() -> Any:
    """mpi4py's MPI module, initialized at thread level SERIALIZED unless the caller chose.

    Where mcrdl imports mpi4py first, it also finalizes MPI at exit itself (`finalize_mpi`,
    an ``atexit`` function) instead of mpi4py (which does it after the interpreter has
    stopped every thread): after failed operations MPI_Finalize can wait in the launcher for
    good for a process that will never come (a host cut off), and the runtime's exit
    watchdog, a thread, can end the process only while threads still run.
    """
    if "mpi4py.MPI" not in sys.modules:
        import atexit

        import mpi4py

        mpi4py.rc.thread_level = "serialized"
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        atexit.register(finalize_mpi)
    from mpi4py import MPI

    return MPI


def mpi_up() -> Any:
    """The mpi4py.MPI module while MPI is initialized and not finalized, else None (without
    importing it)."""
    MPI = sys.modules.get("mpi4py.MPI")  # noqa: N806 - the module
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI
    return None


def finalize_mpi() -> None:
    """MPI_Finalize, unless MPI is not up or is finalized already; then disarm the alarm the
    runtime may have set at exit to bound it (`mcrdl.front._process._finalize_at_exit`)."""
    MPI = mpi_up()  # noqa: N806 - the module
    if MPI is not None:
        MPI.Finalize()
        if threading.current_thread() is threading.main_thread():
            signal.alarm(0)


class Bootstrap:
    """Facts about this process's world, and the shared store backends rendezvous through.

    Attributes:
        rank, size: this process in the world.
        launcher: ``"mpi"``, ``"torchrun"`` or ``"single"``.
        host: this rank's address, which its listening sockets bind (gloo's; rank 0's
            store too): loopback when all ranks share a network, else the address of the
            interface that reaches rank 0, or ``MCRDL_HOST``'s.
        local_size: ranks on this host.
        timeout: seconds a bring-up step may block.
    """

    def __init__(self, config: Config, environ: Mapping[str, str] | None = None,
                 given: tuple[Any, int, int] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.launcher = detect_launcher(env) if given is None else "store"
        self.timeout = config.timeout or 1800.0
        self._store: Any = None
        self._mpi_comm: Any = None
        self._given: Any = None
        self._agent_store = False
        if given is not None:
            self._given, self.rank, self.size = given
            # Its launcher's own store (torchrun's agent, python -m mcrdl run): the one no
            # rank's death takes away, where rank 0's would go with rank 0.
            self._agent_store = (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                                 and env.get("RANK") == str(self.rank)
                                 and env.get("WORLD_SIZE") == str(self.size))
            global _generation
            _generation += 1  # every rank brings mcrdl up as often: the same keys everywhere
            self._prefix = f"mcrdl/{_generation}/"
            names = self._exchange("host", socket.gethostname())
            self.local_size = names.count(names[self.rank])
        elif self.launcher == "mpi":
            try:
                MPI = import_mpi()
            except ImportError as exc:
                raise BackendUnavailableError(
                    "this process was started by an MPI launcher but mpi4py cannot be imported "
                    f"({exc}); install mpi4py and mpich, or launch with torchrun"
                ) from exc
            self._watch_peer_failures()
            self._mpi_comm = comm = MPI.COMM_WORLD.Dup()
            self.rank, self.size = comm.Get_rank(), comm.Get_size()
            names = comm.allgather(MPI.Get_processor_name())
            self.local_size = names.count(names[self.rank])
        elif self.launcher == "torchrun":
            self.rank, self.size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_size = int(env.get("LOCAL_WORLD_SIZE", self.size))
            # torch's env:// rendezvous uses its agent's store then, else rank 0's.
            self._agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        else:
            self.rank, self.size, self.local_size = 0, 1, 1
        self.host = self._address(config, env)

    # -- addresses -------------------------------------------------------------------------

    def _allgather(self, what: str, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order, before any store exists."""
        if self._mpi_comm is not None:
            return self._mpi_comm.allgather(value)  # type: ignore[no-any-return]
        return [json.loads(v) for v in self._exchange(what, json.dumps(value))]

    def _address(self, config: Config, env: Mapping[str, str]) -> str:
        """This rank's address (see ``host``); collective under an MPI launcher or a given
        store, so that every rank raises together when one cannot find its own."""
        if self.launcher == "single":
            return config.host and resolve_host(config.host) or LOOPBACK
        if self.launcher == "torchrun":
            if config.host:
                return resolve_host(config.host)
            return LOOPBACK if self.local_size == self.size else _route_to(env)
        mine: str | None = None
        why = ""
        try:
            mine = resolve_host(config.host) if config.host else None
        except ValueError as exc:
            why = str(exc)
        whys = self._allgather("host-check", why)
        failed = [(r, w) for r, w in enumerate(whys) if w]
        if failed:
            raise ValueError("; ".join(f"rank {r}: {w}" for r, w in failed))
        if mine is not None:
            return mine
        if len(set(self._allgather("net", net_identity()))) == 1:
            return LOOPBACK
        return self._reach_rank0()

    def _reach_rank0(self) -> str:
        """The local address of the interface that reaches rank 0, found by every rank
        connecting to each of rank 0's addresses (`_netaddr`); rank 0's own: the first of its
        addresses that every rank reached."""
        listeners = Listeners(local_addresses(), max(self.size, 16)) if self.rank == 0 else None
        try:
            offered = self._allgather("offers", listeners.offers if listeners else None)[0]
            offers = [(str(n), str(a), int(p)) for n, a, p in offered]
            if self.rank == 0:
                mine: list[str | None] = [addr for _, addr, _ in offers]
            else:
                mine = probe(offers, min(self.timeout, _PROBE_SECONDS))
            reached = self._allgather("reached", mine)
        finally:
            if listeners is not None:
                listeners.close()
        for i in range(len(offers)):
            if all(row[i] is not None for row in reached):
                return str(reached[self.rank][i])
        raise BackendUnavailableError(
            "the ranks are on different networks and not every rank can reach rank 0 on any"
            f" of its addresses within {min(self.timeout, _PROBE_SECONDS):g} s:"
            f" {describe_reach(offers, reached)}; check the network between the hosts, or set"
            " MCRDL_HOST to the interface (or each host's address) the ranks should use"
        )

    def _watch_peer_failures(self) -> None:
        """MPICH's launcher signals SIGUSR1 to the survivors when a rank dies (under
        ``mpiexec -disable-auto-cleanup``; by default it kills them): Python would die of it.
        Ignore it instead: the signal names no rank, and the mesh between the ranks tells
        which one died (`mcrdl.bootstrap._mesh`). A handler the program installed itself is
        left alone."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    @property
    def store_host(self) -> int | None:
        """The world rank whose process serves the store (`store`): rank 0 under mpiexec,
        and under torchrun or with a given store where no launcher's own store is behind
        it; None where the launcher holds it (python -m mcrdl run, torchrun's agent)."""
        return None if self.launcher == "single" or self._agent_store else 0

    def store(self) -> Any:
        """A torch.distributed Store shared by all ranks, made on first use (collective)."""
        if self._store is None:
            self._store = self._make_store()
        return self._store

    def _exchange(self, what: str, value: str) -> list[str]:
        """Every rank's ``value`` through the given store, in rank order."""
        store = self._given
        store.set(f"{self._prefix}{what}/{self.rank}", value)
        keys = [f"{self._prefix}{what}/{r}" for r in range(self.size)]
        store.wait(keys, datetime.timedelta(seconds=self.timeout))
        return [store.get(k).decode() for k in keys]

    def _make_store(self) -> Any:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout)
        if self.launcher == "single":
            return dist.HashStore()  # type: ignore[attr-defined]
        if self.launcher == "torchrun" or self._agent_store:
            rdv = dist.rendezvous  # type: ignore[attr-defined]
            store, _, _ = next(rdv("env://", self.rank, self.size, timeout=timeout))
            return store
        if self.launcher == "store":
            if self.rank == 0:
                store, port = self._serve(timeout)
                self._given.set(f"{self._prefix}store", f"{self.host} {port}")
                return store
            key = f"{self._prefix}store"
            self._given.wait([key], timeout)
            host, port = self._given.get(key).decode().split()
            return dist.TCPStore(host, int(port), self.size, False, timeout)  # type: ignore[attr-defined]
        comm = self._mpi_comm
        why = ""
        if self.rank == 0:
            host = self.host
            try:
                store, port = self._serve(timeout)
            except Exception as exc:
                # Every rank waits in the bcast below for the store's address: tell them.
                comm.bcast((host, None), root=0)
                raise BackendUnavailableError(
                    f"rank 0 could not serve the store on {host}: {exc}") from exc
            comm.bcast((host, port), root=0)
        else:
            host, port = comm.bcast(None, root=0)
            if port is None:
                raise BackendUnavailableError(
                    f"rank 0 could not serve the store on {host} (its error says why)")
            try:
                store = dist.TCPStore(host, port, self.size, False, timeout)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                why = f"rank {self.rank} ({self.host}): {str(exc).splitlines()[0]}"
        # Every rank learns whether all connected (a barrier would leave rank 0 waiting for
        # good for a rank that failed and left).
        failed = [w for w in comm.allgather(why) if w]
        if failed:
            raise BackendUnavailableError(
                f"{len(failed)} rank(s) could not connect to rank 0's store at {host}:{port}:"
                f" {'; '.join(failed)}; set MCRDL_HOST to the interface the ranks reach each"
                " other on"
            )
        return store

    def serve_store(self) -> tuple[Any, str]:
        """A new store served by this rank, and its address for `connect_store`: where the
        survivors of a loss meet when the bootstrap's store may be gone with rank 0
        (`mcrdl.bootstrap._mesh.Mesh.store_for`)."""
        store, port = self._serve(datetime.timedelta(seconds=self.timeout))
        return store, f"{self.host} {port}"

    def connect_store(self, address: str) -> Any:
        """A connection to the store another rank serves at ``address`` (`serve_store`)."""
        import torch.distributed as dist

        host, port = address.rsplit(" ", 1)
        return dist.TCPStore(host, int(port), self.size, False,  # type: ignore[attr-defined]
                             datetime.timedelta(seconds=self.timeout))

    def _serve(self, timeout: datetime.timedelta) -> tuple[Any, int]:
        """Rank 0's TCPStore server on ``host`` (bound here: TCPStore alone listens on every
        interface), and its port."""
        import torch.distributed as dist

        sock = socket.socket(family(self.host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.listen(max(self.size, 16))
        port = sock.getsockname()[1]
        store = dist.TCPStore(  # type: ignore[attr-defined]
            self.host, port, self.size, True, timeout,
            wait_for_workers=False, master_listen_fd=sock.detach())
        return store, port

    def close(self) -> None:
        """Release the bootstrap's MPI communicator and store."""
        if self._mpi_comm is not None:
            self._mpi_comm.Free()
            self._mpi_comm = None
        self._store = self._given = None
