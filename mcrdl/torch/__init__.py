"""mcrdl as a torch.distributed backend: ``dist.init_process_group("mcrdl")``.

Under ``mpiexec``, `init_process_group` here starts both from mcrdl's bootstrap (nothing to
export). Started the torch way instead (torchrun, or a store given to
``dist.init_process_group("mcrdl", store=..., rank=..., world_size=...)`` as torch's test
harness does), mcrdl comes up from torch's store on the first group: gloo only, or MPI and
gloo when an MPI launcher started the processes and its world matches.

Importing this module registers the backend name ``"mcrdl"`` with torch.distributed. Every
collective that code written for torch.distributed issues (DDP's bucket allreduces, FSDP2's
all-gathers and reduce-scatters, ``dist.all_to_all_single``...) then becomes a `CommFuture`
in mcrdl's engine, on the backend mcrdl picks per operation, and mixes safely with the
program's own ``comm.*`` calls on the same communicator::

    import mcrdl.torch
    mcrdl.torch.init_process_group()          # under mpiexec: nothing to export
    model = DDP(model)
    comm = mcrdl.torch.communicator()          # mcrdl's Communicator under the default group

Which backend runs a torch collective: the one pinned for the region
(``with mcrdl.torch.backend("gloo"):``), else the one pinned for its group
(``mcrdl.torch.set_backend(group, "mpi")``), else mcrdl's own choice (the tuning table under
``backend="auto"``, or the default order). A region pin is per thread and per asyncio task
(a context variable): DDP issues its bucket allreduces from the thread that runs backward.

How torch 2.13 sees a backend written in Python (verified against its sources): a subclass of
``ProcessGroup`` returned by the creator replaces the group outright; it must call the
two-argument ``ProcessGroup.__init__(rank, size)`` and define ``getBackendName`` and the
group name and description accessors, which functional collectives and FSDP2 read. Work
objects are subclasses of ``dist._Work``: ``_create_work_from_future`` would report success
after a failure, so `Work.wait` here raises mcrdl's own errors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from _mcrdl_torch import DEVICES

from ..bootstrap._launch import detect_launcher
from ..core._errors import MCRDLError
from ..front._communicator import Communicator
from ..front._process import current_runtime, init
from ._group import BACKEND_NAME, ProcessGroupMCRDL, region

__all__ = ["BACKEND_NAME", "ProcessGroupMCRDL", "backend", "communicator",
           "init_process_group", "set_backend", "shrink"]

_TORCH_DEFAULT_TIMEOUT = dist.constants.default_pg_timeout
#: torch.distributed as this module uses it (its stubs type the group protocol as the
#: user-facing overloads).
_c10d: Any = dist
#: The communicator under torch's default group once `shrink` replaced mcrdl's world there
#: (None: the world).
_default: Communicator | None = None


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[None]:
    """Run the torch collectives issued in this block (this thread or task) on ``name``
    (``"mpi"``, ``"gloo"``, ``"auto"``; None: mcrdl's choice)."""
    token = region.set(name)
    try:
        yield
    finally:
        region.reset(token)


def set_backend(group: Any, name: str | None) -> None:
    """Run ``group``'s torch collectives on ``name`` (None: mcrdl's choice) unless a
    ``backend()`` region says otherwise. ``group``: a process group made by this backend,
    or None for the default group."""
    _pg(group).pinned = name


def communicator(group: Any = None) -> Communicator:
    """The mcrdl `Communicator` under ``group`` (None: the default group), to mix the
    program's own ``comm.*`` calls with what torch.distributed issues on it."""
    return _pg(group).comm


def init_process_group(**kwargs: Any) -> None:
    """``dist.init_process_group("mcrdl")`` with mcrdl's bootstrap: brings mcrdl up (if it is
    not up yet: ``kwargs`` go to `mcrdl.init`) and gives torch its world and store, so that
    nothing needs exporting under ``mpiexec``."""
    runtime = current_runtime()
    if runtime is None:
        init(**kwargs)
        runtime = current_runtime()
    elif kwargs:
        raise MCRDLError(f"mcrdl is up already; init arguments {sorted(kwargs)} would be "
                         f"ignored: pass them to the first mcrdl.init() only")
    world = runtime.world  # type: ignore[union-attr]
    store = runtime.bootstrap.store()  # type: ignore[union-attr]
    dist.init_process_group(BACKEND_NAME, store=_c10d.PrefixStore("mcrdl.torch", store),
                            rank=world.rank, world_size=world.size)


def shrink() -> Communicator:
    """After a loss (`mcrdl.PeerLostError`): torch's default group becomes one of the
    survivors, and their mcrdl `Communicator` is returned. Collective over the live members
    (`Communicator.shrink`: they agree on who is alive). Every group of before is destroyed,
    as ``dist.destroy_process_group()`` does: wrap the model in DDP or FSDP2 again, and make
    other groups again, on the new default group. Ranks are renumbered from 0 in the old
    order (``dist.get_rank()`` changes; the returned communicator's ``members`` are the
    world ranks).

    Raises:
        TypeError: torch's default group is not an mcrdl one.
        MCRDLError: see `Communicator.shrink`.
    """
    global _default
    survivors = _pg(None).comm.shrink()
    runtime = survivors.runtime
    dist.destroy_process_group()
    _default = survivors
    store = _c10d.PrefixStore(f"mcrdl.torch/{survivors.name}", runtime.store())
    dist.init_process_group(BACKEND_NAME, store=store, rank=survivors.rank,
                            world_size=survivors.size)
    return survivors


def _pg(group: Any) -> ProcessGroupMCRDL:
    pg = _c10d.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroupMCRDL):
        raise TypeError(f"{pg!r} is not a process group of backend {BACKEND_NAME!r}; "
                        f"make it with dist.init_process_group({BACKEND_NAME!r}) or new_group")
    return pg


# -- registration ----------------------------------------------------------------------


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupMCRDL:
    """torch.distributed's creator for backend "mcrdl" (extended API: ``opts`` carries the
    store, the group's rank and size, its name and its members' global ranks)."""
    runtime = current_runtime()
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    # torch gives every group a timeout, its default (30 min) unless the program passed one.
    timeout = opts.timeout.total_seconds()
    asked = {} if opts.timeout == _TORCH_DEFAULT_TIMEOUT else {"timeout": timeout}
    if runtime is None:
        if detect_launcher() == "mpi":  # MPI's world, with gloo bootstrapped through it
            init(**asked)
        elif ranks == list(range(opts.group_size)):  # torch's world: bring mcrdl up from it
            init(store=opts.store, rank=opts.group_rank, world_size=opts.group_size, **asked)
        else:
            raise MCRDLError(f"torch.distributed made group {opts.group_id!r} of ranks "
                             f"{ranks} before mcrdl was up; start with the default group")
        runtime = current_runtime()
    elif asked and timeout != runtime.config.timeout:
        warnings.warn(
            f"torch.distributed group {opts.group_id!r} asks for a {timeout:g} s timeout, but "
            f"mcrdl times out every operation after its runtime's "
            f"{runtime.config.timeout} s: pass the timeout to the first mcrdl.init() or "
            f"dist.init_process_group(), or set MCRDL_TIMEOUT", stacklevel=2)
    global _default
    if _default is not None and _default.runtime is not runtime:
        _default = None  # (a runtime of before: finalized)
    world = _default or runtime.world  # type: ignore[union-attr]
    # The default group is mcrdl's world (or the survivors'); every other group, even one of
    # all the ranks, is a communicator of its own: torch orders collectives per group, and
    # two groups sharing a communicator would match one group's collective with the other's.
    # (After a shrink torch numbers its groups anew: their names start from the survivors'.)
    if not dist.is_initialized() and ranks == list(range(world.size)):
        comm = world
    else:
        prefix = "torch" if _default is None else f"{_default.name}.torch"
        comm = runtime.make_communicator(  # type: ignore[union-attr]
            world, f"{prefix}.{opts.group_id}", ranks)
    if comm.rank != opts.group_rank or comm.size != opts.group_size:
        raise MCRDLError(
            f"torch.distributed's group {opts.group_id!r} has this process as rank "
            f"{opts.group_rank} of {opts.group_size}, but mcrdl's world makes it rank "
            f"{comm.rank} of {comm.size}: start torch.distributed from mcrdl's bootstrap "
            f"(mcrdl.torch.init_process_group()) so that both number the ranks alike")
    return ProcessGroupMCRDL(comm, comm.rank, comm.size)


# ``import torch`` registered the name already where mcrdl is installed (its entry point,
# _mcrdl_torch.py, whose creator calls _create here); otherwise it is registered now.
if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=DEVICES)
