"""torch's ``torch.backends`` entry point for mcrdl: ``dist.init_process_group("mcrdl")``
works without ``import mcrdl.torch``.

``import torch`` loads every ``torch.backends`` entry point and calls it; one that raises
breaks ``import torch`` itself. So this registers the name ``"mcrdl"`` with
torch.distributed and nothing more, and swallows any failure: the group's creator imports
mcrdl only when a group is made. It is a module of its own, outside the ``mcrdl`` package,
because importing that package (its engine, numpy) would add to every ``import torch``.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "mcrdl"
#: The devices torch sends to the backend: one group serves both, as torch's default groups
#: do (an object collective on CPU beside gradients on CUDA).
DEVICES = ["cpu", "cuda"]


def register() -> None:
    """Register ``"mcrdl"`` with torch.distributed, unless it is there already."""
    try:
        import torch.distributed as dist

        if dist.is_available() and BACKEND_NAME not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                          devices=DEVICES)
    except Exception:  # noqa: BLE001 - never break ``import torch``; mcrdl.torch registers too
        pass


def _create(*args: Any, **kwargs: Any) -> Any:
    """The group creator torch calls: mcrdl.torch's, imported now."""
    from mcrdl.torch import _create as create

    return create(*args, **kwargs)
