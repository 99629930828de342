"""``Communicator.shrink``: the survivors of a loss agree on who is alive and make a new
communicator of them (docs/design.md, rule 9).

Two rounds of the survivors' agreement per attempt, through the launcher's store
(`mcrdl.bootstrap._agree`) or, where the store lives in a rank, the mesh between the ranks
(`mcrdl.bootstrap._mesh`; `_meeting` picks):

1. **Who is in.** Every live member says so; the answer is the same set on every one of
   them.
2. **Who made it.** Each makes its groups among that set (`Backend.regroup`, on a thread: a
   member that dies meanwhile leaves the others' group creation waiting in the backend, so
   the caller stops watching it once that member is known gone), then says whether it did.
   If every member of the set did, that is the new communicator. Otherwise the attempt's
   groups are given up (`Backend.abandon`: a peer may still be connected to them) and the
   next attempt starts from the set of the first round, with new keys and new group names.
   Attempts that fail with no member known gone (a death can fail a group creation before
   its notice arrives) are retried twice; the third fails the shrink on every member, with
   their errors.

Every member goes through the same attempts, since each round's answer is the same on each.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..bootstrap._agree import Meeting
from ..core._errors import BackendUnavailableError, MCRDLError

if TYPE_CHECKING:
    from ._communicator import Communicator
    from ._runtime import Runtime

__all__ = ["shrink"]

#: Seconds between two looks at the gone ranks while a group creation is under way.
_WATCH = 0.01
#: A member's answer when a member it made its groups with is gone.
_GONE = "a member is gone"
#: Attempts that failed with nobody known gone, after the first, before the shrink fails: a
#: death can fail a group creation before its notice has arrived anywhere.
_RETRIES = 2

Groups = tuple[dict[str, Any], dict[str, Any], Any]


def shrink(runtime: Runtime, comm: Communicator) -> tuple[str, Groups, tuple[int, ...]]:
    """The name, groups and members (world ranks, in rank order) of the communicator of
    ``comm``'s live members, agreed by all of them (see the module docstring).

    Raises:
        BackendUnavailableError: no backend of ``comm`` that reaches host memory can make a
            group once members are gone (`_without`), or there is no launched job's store to
            agree through (`_meeting`).
        MCRDLError: a live member did not take part within the bootstrap's timeout, or could
            not make its groups while nobody died.
    """
    without = _without(runtime, comm)
    meeting = _meeting(runtime, comm)
    engine = runtime.engine

    def gone() -> set[int]:
        engine.check_signals()  # (applies the deaths told since the last look)
        return set(engine.gone)

    runtime.shrinks[comm.name] = n = runtime.shrinks.get(comm.name, 0) + 1
    members = list(comm.members)
    attempt = 0
    while True:
        key = f"mcrdl/shrink/{comm.name}/{n}/{attempt}"
        live = list(meeting.agree(f"{key}/in", members, "in", gone))
        name = f"{comm.name}.s{n}" + (f"r{attempt}" if attempt else "")
        try:
            store = meeting.store_for(key, live, gone)
        except MCRDLError:  # (its host is gone)
            made, error = None, _GONE
        else:
            made, error = _make(runtime, comm, [comm.members.index(m) for m in live], name,
                                live, gone, store, without)
        if made is None and gone() & set(live):
            error = _GONE  # (what failed it, whether or not its watcher saw it first)
        said = meeting.agree(f"{key}/made", live, "ok" if made is not None else error, gone)
        if made is not None and len(said) == len(live) and all(v == "ok" for v in said.values()):
            _go_on_through(runtime, store, live[0], gone)
            return name, made, tuple(live)
        if made is not None:
            _abandon(runtime, made)
        died = len(said) < len(live) or _GONE in said.values()
        if not died and attempt >= _RETRIES:  # nobody died: another attempt would fail alike
            raise MCRDLError(
                f"cannot shrink {comm.name}: " + "; ".join(
                    f"rank {m} failed: {v}" for m, v in said.items() if v != "ok"))
        members = live
        attempt += 1


def _without(runtime: Runtime, comm: Communicator) -> list[str]:
    """The backends of ``comm`` that cannot make a group once members are gone (MPICH: its
    launcher fails, its fault-tolerant mode does not start), which the survivors go on
    without, saying so; the new communicator refuses an operation named for one.

    Raises:
        BackendUnavailableError: no backend that reaches host memory would be left (mcrdl's
            own exchanges need one).
    """
    without = sorted(n for n in comm._slots
                     if not runtime._backends[n].capabilities.regroups_after_loss)
    why = ("cannot make a group once members are gone (MPICH's launcher fails, and its "
           "fault-tolerant mode does not start; Open MPI's can, under mpiexec --with-ft ulfm)")
    left = [n for n in comm._slots if n not in without
            and "cpu" in runtime._backends[n].capabilities.devices]
    if without and not left:
        raise BackendUnavailableError(
            f"cannot shrink {comm.name}: backend(s) {', '.join(without)} {why}, and no other "
            f"backend that reaches host memory is up (bring gloo up too)")
    if without:
        warnings.warn(f"{comm.name}'s survivors go on without backend(s) {', '.join(without)}, "
                      f"which {why}", RuntimeWarning, stacklevel=5)
    return without


def _meeting(runtime: Runtime, comm: Communicator) -> Any:
    """Where the survivors of ``comm`` agree: where the store lives in a rank that may be
    the one gone (mpiexec, a given store), the mesh between the ranks
    (`mcrdl.bootstrap._mesh`); else the launcher's store, or the meeting point the runtime
    was given (a simulated world's).

    Raises:
        BackendUnavailableError: there is none (a runtime made without a launcher).
    """
    if runtime.mesh is not None:
        return runtime.mesh
    if runtime._meeting is None:
        bootstrap = runtime.bootstrap
        if bootstrap is None:
            raise BackendUnavailableError(
                "this runtime has no launched job's store for the survivors to agree through")
        runtime._meeting = Meeting(bootstrap.store(), bootstrap.rank, bootstrap.timeout)
    return runtime._meeting


def _go_on_through(runtime: Runtime, store: Any, host: int,
                   gone: Callable[[], set[int]]) -> None:
    """Once the bootstrap's store went with its rank (mpiexec), the survivors' ``store``,
    served by world rank ``host`` (`mcrdl.bootstrap._mesh.Mesh.store_for`), goes on in its
    place: the runtime's (`Runtime.store`) and the notices' (a connection of their own, as
    at init). Not where ``host`` is gone too (it died once it had made its groups): the new
    communicator is broken already, and the shrink that follows moves on."""
    bootstrap = runtime.bootstrap
    if bootstrap is None or bootstrap.store_host not in runtime.engine.gone or host in gone():
        return
    if runtime.notices is not None:
        try:
            runtime.notices.move(store.clone(), host)
        except Exception:  # noqa: BLE001 - ``host`` died meanwhile: as above
            return
    runtime._store = store


def _make(runtime: Runtime, comm: Communicator, indices: list[int], name: str,
          live: list[int], gone: Callable[[], set[int]], store: Any,
          without: list[str]) -> tuple[Groups | None, str]:
    """``name``'s groups among ``indices`` (ranks of ``comm``; world ranks ``live``) on its
    backends but those ``without``, made through ``store`` (the attempt's own:
    `Meeting.store_for`), or None and why: it failed, or a member of ``live`` is gone before
    it finished."""
    result: list[Any] = []

    def build() -> None:
        try:
            result.append(runtime.make_groups(comm, indices, name, store, without))
        except Exception as exc:  # noqa: BLE001 - reported to every member by the agreement
            result.append(exc)

    thread = threading.Thread(target=build, name="mcrdl-shrink", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_WATCH)
        if gone() & set(live) and thread.is_alive():  # (left to end on the backend's timeout)
            return None, _GONE
    made = result[0]
    if isinstance(made, Exception):
        return None, f"{type(made).__name__}: {str(made).splitlines()[0] if str(made) else ''}"
    return made, ""


def _abandon(runtime: Runtime, made: Groups) -> None:
    """Give up the groups of an attempt that did not complete on every member."""
    groups, named, debug = made
    for bname, group in [*groups.items(), *named.items()]:
        runtime._backends[bname].abandon(group)
    if debug is not None:
        runtime._backends[runtime.control_of(groups)].abandon(debug)
