"""ULFM, Open MPI's fault tolerance (``mpiexec --with-ft ulfm``), as the mpi backend uses it:
whether it is on, and who the members of a shrunk communicator are. Who died and who is
left is learned and agreed by the mesh between the ranks (`mcrdl.bootstrap._mesh`); MPI's
part is to make its own communicator of the survivors (``Shrink``, collective over the live
members only: docs/design.md, "Survivors").

MPICH has the same calls, but its fault-tolerant mode does not start (docs/design.md), so
none of this is used there.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["enabled", "ranks_in"]


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
