"""The simulated world's tests: properties over generated programs, traps, broken policies."""

import os


def examples(n: int) -> int:
    """Programs a property draws by default, ``n``, times ``MCRDL_EXAMPLES_SCALE`` (default
    1): the default run keeps the suite within its time here; a longer search runs the same
    properties with more programs, e.g. ``MCRDL_EXAMPLES_SCALE=5 python -m pytest tests/sim``."""
    return max(1, round(n * float(os.environ.get("MCRDL_EXAMPLES_SCALE", "1"))))
