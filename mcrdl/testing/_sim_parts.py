"""What a simulated rank's runtime is given in place of a real job's (`mcrdl.testing._world`):
the rendezvous its backends come up from, the condition variables its worker threads wait
on, the notice board that carries breaks and losses, and the store where survivors agree.
Each hands the world's baton on, or counts as progress, where the real one would block or
deliver."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine import Engine
    from ._world import SimWorld

__all__ = ["Condition", "Notices", "Rendezvous", "Store"]


class Rendezvous:
    """What a SimBackend is made from (the Rendezvous protocol, plus the world)."""

    def __init__(self, world: SimWorld, rank: int, name: str, semantics: str) -> None:
        self.sim_world = world
        self.sim_name = name
        self.sim_semantics = semantics
        self.rank = rank
        self.size = world.size
        self.launcher = "sim"
        self.host = "sim"
        self.timeout = 0.0

    def store(self) -> Any:
        raise RuntimeError("simulated backends need no store")


class Condition:
    """A condition variable for simulated threads: waiting hands the baton back."""

    def __init__(self, world: SimWorld) -> None:
        self._world = world

    def __enter__(self) -> Condition:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait(self) -> None:
        self._world.yield_()

    def notify(self) -> None:
        self._world.note_progress()


class Notices:
    """The simulated notice board: a rank's break reaches its peers' engines at once (they
    apply it at their next check, as real ranks do when the store delivers it)."""

    def __init__(self, world: SimWorld, rank: int, engine: Engine) -> None:
        self._world = world
        self._rank = rank
        engine.on_break = self.tell

    def tell(self, comm: Any, cause: str, stops: Any) -> None:
        gone = self._world.runtimes[self._rank].engine.gone
        for member in comm.members:
            if member != self._rank:
                engine = self._world.runtimes[member].engine
                for lost in sorted(comm.lost):  # (as the real notices relay them)
                    engine.post_lost(lost, gone.get(lost, ""))
                engine.post_break(comm.name, cause, comm.rank, stops)
        self._world.note_progress()

    def close(self) -> None:
        pass


class Store:
    """The simulated world's store, where survivors agree (`mcrdl.bootstrap._agree`): what
    it needs of a torch store, in memory; a write is progress."""

    def __init__(self, world: SimWorld) -> None:
        self._world = world
        self._keys: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self._keys[key] = value.encode() if isinstance(value, str) else value
        self._world.note_progress()

    def check(self, keys: list[str]) -> bool:
        return all(k in self._keys for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._keys[k] for k in keys]

    def clone(self) -> Store:
        return self
