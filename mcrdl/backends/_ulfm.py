"""ULFM, Open MPI's fault tolerance (``mpiexec --with-ft ulfm``), as the mpi backend uses it:
how it learns that processes died, and how the survivors agree (`Communicator.shrink`)
without the bootstrap's store, which lives in rank 0 under mpiexec and dies with it.

What it rests on (measured with Open MPI 5.0.11; docs/design.md, "Survivors"):

- A receive from any source fails (``ERR_PROC_FAILED_PENDING``) within tens of milliseconds
  of the death of a member of its communicator, when it is tested. Once the failures are
  acknowledged (``Ack_failed``) it watches for the next one.
- ``Revoke`` makes every member's pending and later operations on a communicator fail, so
  that nobody stays blocked in a collective that a death left incomplete.
- ``Shrink`` and ``Agree`` are collective over the live members only and complete despite
  deaths during them. ``Agree`` gives every live member the same flag, or fails on each.

MPICH has the same calls, but its fault-tolerant mode does not start (docs/design.md), so
none of this is used there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..core import MCRDLError
from ..core._forever import forever

__all__ = ["Agreement", "Watch", "enabled", "ranks_in"]

#: Tests of the watching receive per look: Open MPI handles a failure's notice over several
#: progress calls, so that one test per look learned of a death only 3 to 8 looks after it
#: (0.75 to 2 s at the engine's 0.25 s checks), eight in a row at the first look after it
#: (docs/performance-log.md, "Survivors under Open MPI's ULFM").
_TESTS = 8
#: The stores this process serves to the survivors (`Agreement.store_for`).
_SERVED: list[Any] = forever([])
#: How the watch describes a process whose failure MPI reported.
FAILED = "its process failed (MPI's fault tolerance reported it)"


def enabled(MPI: Any) -> bool:
    """Whether this MPI runs with ULFM: Open MPI with its fault tolerance on (its
    ``mpiexec --with-ft ulfm`` sets the MCA parameter ``mpi_ft_enable`` for each rank)."""
    on = os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on")
    return on and MPI.Get_library_version().startswith("Open MPI")


def ranks_in(MPI: Any, comm: Any, other: Any) -> list[int]:
    """The ranks in ``other`` of ``comm``'s members, in ``comm``'s rank order (local: no
    communication)."""
    group, of = comm.Get_group(), other.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), of))
    finally:
        group.Free()
        of.Free()


class Watch:
    """The world's failed processes, as a receive from any source that never matches learns
    them: on a communicator of its own, tested by ``lost`` (the engine calls it every check
    interval and when an operation fails). Callers serialize it with their other MPI calls.
    """

    def __init__(self, MPI: Any) -> None:
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD.Dup()
        self._buf = bytearray(1)
        self._request = self._comm.Irecv([self._buf, MPI.BYTE], MPI.ANY_SOURCE, 0)
        self._lost: dict[int, str] = {}

    def lost(self) -> dict[int, str]:
        """The world ranks known failed, with how (a copy)."""
        try:
            for _ in range(_TESTS):
                self._request.Test()
        except self._MPI.Exception:
            # Acknowledged, the failures known so far no longer fail the receive: it goes
            # on watching for the next.
            self._comm.Ack_failed()
            self.learn()
        return dict(self._lost)

    def learn(self) -> dict[int, str]:
        """Add the failures this process knows of (an operation just failed for one), and
        return them all."""
        MPI = self._MPI
        group, world = self._comm.Get_failed(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
        finally:
            group.Free()
            world.Free()
        for rank in ranks:
            self._lost.setdefault(rank, FAILED)
        return dict(self._lost)

    def close(self) -> None:
        """Withdraw the receive and free the communicator."""
        MPI = self._MPI
        try:
            self._request.Cancel()
            self._request.Wait()
        except MPI.Exception:
            pass
        self._comm.Free()


class Agreement:
    """The survivors' agreement (the contract of `mcrdl.bootstrap._agree.Meeting`) over a
    group's communicator: every member's value is gathered, then every member agrees that it
    got them all (``Agree``). If one did not (a member died), the communicator is revoked and
    shrunk to its live members, and the round runs again among them. Rounds run in the same
    order on every member, so no key is needed to keep them apart.

    ``store_for`` gives each attempt of a shrink a store of its own for the backends whose
    members meet through one (gloo), hosted by the first live member: the bootstrap's, in
    rank 0, may be gone.

    ``lock`` serializes its MPI calls with the engine's (MPI runs THREAD_SERIALIZED).
    """

    def __init__(self, MPI: Any, comm: Any, lock: threading.Lock, rank: int,
                 serve: Callable[[], tuple[Any, str]], connect: Callable[[str], Any]) -> None:
        self._MPI = MPI
        self._comm = comm
        self._lock = lock
        self.rank = rank
        self._serve = serve
        self._connect = connect

    def agree(self, key: str, members: Sequence[int], value: str,
              gone: Callable[[], Collection[int]]) -> dict[int, str]:
        """What each live one of ``members`` (world ranks) said, the same on every one.

        Raises:
            MCRDLError: MPI could not shrink the communicator to its live members.
        """
        MPI = self._MPI
        with self._lock:
            while True:
                comm = self._comm
                try:
                    values = comm.allgather(value)
                    ok = 1
                except MPI.Exception:
                    comm.Revoke()  # (a member blocked in the gather would wait for good)
                    values, ok = [], 0
                try:
                    ok = comm.Agree(ok)
                except MPI.Exception:
                    ok = 0
                if ok:
                    break
                try:
                    self._comm = comm.Shrink()
                except MPI.Exception as exc:
                    raise MCRDLError(f"{key}: MPI could not shrink the communicator to its "
                                     f"live members: {exc.Get_error_string()}") from None
            ranks = ranks_in(MPI, comm, MPI.COMM_WORLD)
        wanted = set(members)
        return {r: v for r, v in sorted(zip(ranks, values, strict=True)) if r in wanted}

    def store_for(self, key: str, live: Sequence[int],
                  gone: Callable[[], Collection[int]]) -> Any:
        """A store for one attempt's group creation, served by ``live[0]``.

        Raises:
            MCRDLError: ``live[0]`` is gone before it told where its store is, or before
                this member reached it.
        """
        host = live[0]
        served = self._serve() if self.rank == host else None
        said = self.agree(f"{key}/store", live, "" if served is None else served[1], gone)
        if host not in said:
            raise MCRDLError(f"{key}: rank {host}, which was to serve the store, is gone")
        if served is not None:
            # The server lives as long as the process (any survivor may still reach it); the
            # attempt gets a connection of its own, as every other member has.
            _SERVED.append(served[0])
            return served[0].clone()
        try:
            return self._connect(said[host])
        except Exception as exc:  # noqa: BLE001 - torch's store errors: the host is gone
            raise MCRDLError(f"{key}: rank {host}'s store at {said[host]} cannot be "
                             f"reached: {str(exc).splitlines()[0] if str(exc) else exc}"
                             ) from exc
