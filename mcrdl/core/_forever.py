"""References that are never dropped: what a backend may use until the process ends."""

from __future__ import annotations

import ctypes
from typing import TypeVar

__all__ = ["forever"]

T = TypeVar("T")


def forever(obj: T) -> T:
    """``obj``, given one more reference that nobody ever drops.

    The interpreter's teardown at exit empties every module's globals, so an object kept in a
    module-level list is deallocated then, before the process ends; this one never is. That is
    what a backend may still be using at that point needs: MPI_Finalize runs after the teardown
    (mpi4py calls it from ``Py_AtExit``) and may still move the bytes of an abandoned
    operation, so its request, its memory and its communicator must outlive it; and a gloo
    group's destruction joins gloo's threads, which wait in an abandoned collective until
    gloo's own timeout. Only for objects that must last as long as the process does.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj
