"""The versions mcrdl has been run with, and what it says about others.

pyproject.toml declares the same torch range; a torch outside it is not refused (the user's
own build may well work), but ``init()`` warns once, naming the range.
"""

from __future__ import annotations

import warnings

__all__ = ["TORCH_TESTED", "check_torch", "torch_in_range"]

#: torch releases (major, minor) mcrdl has been run with: 2.13 CPU, 2.11 with CUDA 13.
TORCH_TESTED = ((2, 11), (2, 13))


def torch_in_range(version: str) -> bool:
    """Whether torch ``version`` ("2.13.0+cpu") is within `TORCH_TESTED`."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return TORCH_TESTED[0] <= (major, minor) <= TORCH_TESTED[1]


def check_torch() -> None:
    """Warn (once per process) where the torch this process imported is outside the range."""
    import torch

    version = torch.__version__
    if not torch_in_range(version):
        (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_TESTED
        warnings.warn(
            f"mcrdl has been run with torch {lo_major}.{lo_minor} to {hi_major}.{hi_minor}; "
            f"this is torch {version}, which may work but is untested: the torch.distributed "
            f"backend relies on torch's group and Work internals",
            RuntimeWarning, stacklevel=3)
