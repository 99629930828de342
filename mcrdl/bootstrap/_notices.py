"""Notices: how a rank tells its peers that a communicator broke (docs/design.md rule 7).

A break is decided on one rank: one of its operations will not run as the peers expect (see
`mcrdl.engine.CommState`). Its peers must stop too, within the runtime's timeout, naming that
cause, or they would wait for an operation that never comes (and, had the lane gone on,
match the wrong one); and each member must learn where the others stopped issuing, so that
what every member issued still finishes and the rest fails. Each member that stops tells
every other member its stops. The bootstrap's store carries the notice: the breaking rank pushes it
onto each member's queue in the store (``queue_push``), from a short-lived thread so that the
caller never waits on the network; every rank has a thread blocked in ``queue_pop`` on its own
queue, over a connection of its own (a ``clone`` of the store: the main connection also
serves gloo's rendezvous), which hands each notice to the engine. Nothing polls: the listener
sleeps in the store's server until a notice, or its own stop, arrives. A launcher that hosts
the store and sees a rank's process end (``python -m mcrdl run``) pushes a notice of its own,
``{"lost": rank, "cause": ...}``: every communicator that rank is a member of breaks
(`PeerLostError`), idle or not.

Rejected (docs/reliability.md, "Rejected"): reading a key from the progress loop (a store
round trip, far dearer than a poll, on the waiting thread every few milliseconds), and MPI
messages (there is no MPI under torchrun, and a posted receive would be tested on every poll).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine import CommState, Engine
    from ..engine._lanes import Stops

__all__ = ["Notices"]

_log = logging.getLogger("mcrdl")
_STOP = "stop"
#: How long the listener's connection waits in one ``queue_pop`` (it is woken to stop).
_FOREVER = datetime.timedelta(days=3650)


class Notices:
    """This rank's side of the notice board: tells peers of its breaks, listens for theirs.

    Invariants: the listener thread runs from construction until ``close``; ``engine.on_break``
    is this object's ``tell`` meanwhile.
    """

    def __init__(self, store: Any, rank: int, engine: Engine, host: int | None = None) -> None:
        self._store = store
        #: The world rank whose process serves the store (None: the launcher's, or a file).
        self._host = host
        self._rank = rank
        self._engine = engine
        self._key = f"mcrdl/notices/{rank}"
        self._closed = False
        self._thread = self._start(store)
        engine.on_break = self.tell

    def _start(self, store: Any) -> threading.Thread:
        reader = store.clone()
        reader.set_timeout(_FOREVER)
        thread = threading.Thread(target=self._listen, args=(reader,), name="mcrdl-notices",
                                  daemon=True)
        thread.start()
        return thread

    def move(self, store: Any, host: int) -> None:
        """Go on through ``store``, served by world rank ``host``: the survivors' own, once
        the store's process is gone (`mcrdl.front._shrink`; the listener's
        connection went with it)."""
        self._store, self._host = store, host
        self._thread = self._start(store)

    def tell(self, comm: CommState, cause: str, stops: Stops) -> None:
        """Tell ``comm``'s other members that this rank stopped issuing on it at ``stops``,
        the communicator broken for ``cause`` (returns at once)."""
        payload = json.dumps({
            "comm": comm.name, "cause": cause, "rank": comm.rank,
            # Members it knows are gone (the launcher told it first): the peer's errors
            # then say so too, whichever notice reaches it first.
            "gone": {str(r): self._engine.gone.get(r, "") for r in sorted(comm.lost)},
            "stops": {key: [first, [[*stream, n] for stream, n in streams.items()]]
                      for key, (first, streams) in stops.items()},
        })
        peers = [m for m in comm.members if m != self._rank]
        if peers:
            threading.Thread(target=self._push, args=(peers, payload),
                             name="mcrdl-notice", daemon=True).start()

    def _push(self, peers: list[int], payload: str) -> None:
        for peer in peers:
            if self._host_gone():  # (each survivor learns of deaths from the mesh)
                return
            try:
                self._store.queue_push(f"mcrdl/notices/{peer}", payload)
            except Exception as exc:  # noqa: BLE001 - a lost peer or store: its timeout remains
                _log.warning("mcrdl could not tell rank %d of a broken communicator: %s",
                             peer, str(exc).splitlines()[0] if str(exc) else exc)

    def _listen(self, reader: Any) -> None:
        while True:
            try:
                raw = reader.queue_pop(self._key)
            except Exception as exc:  # noqa: BLE001 - the store went away (finalize, a death)
                if not self._closed:
                    _log.debug("mcrdl stops listening for notices: %s", exc)
                return
            if raw == _STOP.encode() and self._closed:
                return
            try:
                notice = json.loads(raw)
                if "lost" in notice:  # from the launcher (python -m mcrdl run): a process died
                    self._engine.learn_lost(int(notice["lost"]), str(notice["cause"]))
                    continue
                for lost, why in notice.get("gone", {}).items():
                    self._engine.post_lost(int(lost), str(why))
                stops: Stops = {
                    key: (first, {(peer, tag, bool(sends)): n for peer, tag, sends, n in streams})
                    for key, (first, streams) in notice["stops"].items()}
                comm, cause, peer = notice["comm"], notice["cause"], notice["rank"]
            except (ValueError, KeyError, TypeError):
                _log.warning("mcrdl ignored a malformed notice: %r", raw[:200])
                continue
            self._engine.post_break(comm, cause, peer, stops)
            self._engine.check_signals()

    def close(self) -> None:
        """Stop listening (idempotent). The engine no longer tells anybody of breaks."""
        if self._closed:
            return
        self._closed = True
        if self._engine.on_break == self.tell:
            self._engine.on_break = None
        if self._host_gone():  # (the listener's connection went with it)
            return
        try:
            self._store.queue_push(self._key, _STOP)
        except Exception:  # noqa: BLE001 - the store is gone: so is the listener's connection
            return
        self._thread.join(timeout=5.0)

    def _host_gone(self) -> bool:
        """Whether the store's process is gone (rank 0's under mpiexec): nothing can be told
        through it any more."""
        return self._host is not None and self._host in self._engine.gone
