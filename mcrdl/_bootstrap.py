"""Bootstrap: which launcher started this process, who we are, and a store for the backends.

- ``mpiexec``/``srun`` (PMI or OpenMPI variables present): MPI is initialized here, at thread
  level SERIALIZED (all MPI calls go through the engine's lock; MULTIPLE doubles the cost of a
  small call), and the store for gloo is bootstrapped through MPI: rank 0 listens on loopback
  when every rank shares its host (on ``MCRDL_HOST`` or the host's address otherwise) and
  broadcasts the port. No MASTER_ADDR/MASTER_PORT needed.
- ``torchrun`` (``TORCHELASTIC_RUN_ID``, or ``RANK``/``WORLD_SIZE``): no MPI; the store is the
  launcher's rendezvous (``env://``).
- a store given to ``init(store=, rank=, world_size=)`` (``"store"``: torch.distributed started
  first, e.g. ``dist.init_process_group("mcrdl", store=...)`` under torch's test harness): no
  MPI; rank 0 serves a TCPStore of mcrdl's own on the agreed host and publishes its address
  through the given store (mcrdl needs a store with queues, which a FileStore lacks).
- anything else: a world of one, with an in-process store.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
from collections.abc import Mapping
from typing import Any

from ._config import Config
from ._errors import BackendUnavailableError

__all__ = ["Bootstrap", "detect_launcher"]

_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
_LOOPBACK = "127.0.0.1"
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


def import_mpi() -> Any:
    """mpi4py's MPI module, initialized at thread level SERIALIZED unless the caller chose."""
    import sys

    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    return MPI


class Bootstrap:
    """Facts about this process's world, and the shared store backends rendezvous through.

    Attributes:
        rank, size: this process in the world.
        launcher: ``"mpi"``, ``"torchrun"`` or ``"single"``.
        host: where to bind listening sockets (loopback when all ranks share a host).
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
        #: Called (from a signal handler: flag-setting only) when a peer process dies.
        self.on_peer_failure: list[Any] = []
        if given is not None:
            self._given, self.rank, self.size = given
            global _generation
            _generation += 1  # every rank brings mcrdl up as often: the same keys everywhere
            self._prefix = f"mcrdl/{_generation}/"
            names = self._exchange("host", socket.gethostname())
            self.local_size = names.count(names[self.rank])
            one_host = len(set(names)) == 1
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
            one_host = len(set(names)) == 1
        elif self.launcher == "torchrun":
            self.rank, self.size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_size = int(env.get("LOCAL_WORLD_SIZE", self.size))
            one_host = self.local_size == self.size
        else:
            self.rank, self.size, self.local_size = 0, 1, 1
            one_host = True
        if config.host:
            self.host = config.host
        elif one_host:
            self.host = _LOOPBACK
        else:
            self.host = socket.gethostbyname(socket.gethostname())

    def _watch_peer_failures(self) -> None:
        """MPICH's launcher signals SIGUSR1 to the survivors when a rank dies (under
        ``mpiexec -disable-auto-cleanup``; by default it kills them): Python would die of it.
        Catch it instead, and let the runtime fail what is in flight (CommAbortedError).
        A handler the program installed itself is left alone."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGUSR1, self._peer_failed)

    def _peer_failed(self, signum: int, frame: Any) -> None:
        for callback in list(self.on_peer_failure):
            callback("a peer process died (the MPI launcher signalled SIGUSR1)")

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
        if self.launcher == "torchrun":
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
        if self.rank == 0:
            store, port = self._serve(timeout)
            comm.bcast((self.host, port), root=0)
        else:
            host, port = comm.bcast(None, root=0)
            store = dist.TCPStore(host, port, self.size, False, timeout)  # type: ignore[attr-defined]
        comm.Barrier()
        return store

    def _serve(self, timeout: datetime.timedelta) -> tuple[Any, int]:
        """Rank 0's TCPStore server on ``host`` (bound here: TCPStore alone listens on every
        interface), and its port."""
        import torch.distributed as dist

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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
