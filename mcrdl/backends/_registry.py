"""The backend registry: names to ``"module:Class"`` entries, imported only when asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..core._errors import UnknownBackendError

if TYPE_CHECKING:
    from ._contract import Backend

__all__ = ["available_backends", "backend_class", "known_backends", "register_backend"]

_ENTRIES: dict[str, str] = {
    "mpi": "mcrdl.backends.mpi:MPIBackend",
    "gloo": "mcrdl.backends.gloo:GlooBackend",
    "nccl": "mcrdl.backends.nccl:NCCLBackend",
    "cupy-nccl": "mcrdl.backends.cupy_nccl:CupyNCCLBackend",
    "sim": "mcrdl.backends.sim:SimBackend",
}


def register_backend(name: str, entry: str) -> None:
    """Register (or replace) the backend ``name`` as ``"package.module:ClassName"``."""
    if ":" not in entry:
        raise ValueError(f"backend entry {entry!r} must read 'package.module:ClassName'")
    _ENTRIES[name] = entry


def known_backends() -> tuple[str, ...]:
    """Every registered name, sorted, whether or not it can run here."""
    return tuple(sorted(_ENTRIES))


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``, imported now.

    Raises:
        UnknownBackendError: no such name.
    """
    entry = _ENTRIES.get(name)
    if entry is None:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known: {', '.join(known_backends())}"
        )
    module, _, cls = entry.partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def available_backends() -> tuple[str, ...]:
    """The registered names whose ``is_available()`` is true (imports their modules)."""
    found = []
    for name in known_backends():
        try:
            ok = backend_class(name).is_available()
        except ImportError:
            ok = False
        if ok:
            found.append(name)
    return tuple(found)
