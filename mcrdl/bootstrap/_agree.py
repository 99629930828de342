"""The survivors' agreement: after a loss, every live member learns one and the same answer
(`Communicator.shrink`; docs/design.md, rule 9).

Each member writes its value under its own key in the bootstrap's store, then waits until
every other member has written its own or is known to be gone (the launcher told: the
engine's ``gone``). What comes back is what each member wrote, the gone ones that never wrote
left out, and it is the same on every member, however late each learns of a death:

- a member's write comes before its death, its death before the launcher's notice, the
  notice before the snapshot of the gone ranks in which it appears, and that snapshot before
  the keys are read: a gone member that wrote is always read;
- a member in nobody's snapshot is alive, and is waited for;
- a gone member that did not write never will.

So the answer is "every member that wrote", fixed once the last live member has written.
This needs a store that outlives every rank: ``python -m mcrdl run`` hosts it in the
launcher, as torchrun's agent does. Where the store lives in a rank (mpiexec, a given
store), the survivors agree through the mesh between the ranks instead
(`mcrdl.bootstrap._mesh.Mesh`, the same contract).

It polls the store (a round trip every few milliseconds) while it waits: only after a loss,
never in the steps of a job where nobody dies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import MCRDLError

__all__ = ["Meeting"]

#: Seconds between two reads of the store while members are missing.
_POLL = 0.002


@dataclass(frozen=True)
class Meeting:
    """Where the survivors agree: a ``store`` every rank reaches (set, check, multi_get,
    clone: a torch store), this process's world ``rank``, how many seconds a round may wait
    (``timeout``), and how to wait between two reads (``pause``; a simulated world hands its
    baton on instead of sleeping)."""

    store: Any
    rank: int
    timeout: float
    pause: Callable[[float], None] = time.sleep

    def agree(self, key: str, members: Sequence[int], value: str,
              gone: Callable[[], Collection[int]]) -> dict[int, str]:
        """Write ``value`` as this member at ``key``; return what each of ``members`` wrote
        there (world ranks), once each has written or is gone: the same on every member.

        ``gone`` gives the ranks known gone so far (it may grow between calls, never
        shrink).

        Raises:
            MCRDLError: some live member had not written after ``timeout`` seconds, naming
                them (a member that never reached its ``shrink``, or died where no launcher
                told).
        """
        def slot(m: int) -> str:
            return f"{key}/{m}"

        store, timeout = self.store, self.timeout
        store.set(slot(self.rank), value)
        deadline = time.monotonic() + timeout
        while True:
            lost = set(gone())  # (before the keys are read: see the module docstring)
            live = [m for m in members if m not in lost]
            if store.check([slot(m) for m in live]):
                wrote = live + [m for m in members if m in lost and store.check([slot(m)])]
                values = store.multi_get([slot(m) for m in wrote])
                return {m: v.decode() for m, v in sorted(zip(wrote, values, strict=True))}
            if time.monotonic() > deadline:
                missing = [m for m in live if not store.check([slot(m)])]
                raise MCRDLError(
                    f"{key}: ranks {missing} neither answered within {timeout:g} s nor are "
                    f"known gone: each live member must call shrink(); a process that died "
                    f"is known gone only where a launcher tells (python -m mcrdl run, "
                    f"torchrun's agent) or the ranks keep a mesh (the store in a rank)")
            self.pause(_POLL)

    def store_for(self, key: str, live: Sequence[int],
                  gone: Callable[[], Collection[int]]) -> Any:
        """A connection of its own to the store, for one attempt's group creation (a
        creation given up while it waits for a member that is gone holds its connection
        until the backend's timeout: neither the agreement nor the next attempt may queue
        behind it)."""
        return self.store.clone()
