"""What every layer shares: errors, vocabulary types, buffers and configuration.

Nothing here imports any other part of mcrdl, so every layer may import it.
"""

from ._buffers import Buffer, as_buffer, new_buffer
from ._config import DEFAULT_FUSION_BYTES, DEFAULT_TIMEOUT, Config
from ._errors import *  # noqa: F403 - every exception is part of the vocabulary
from ._errors import __all__ as _errors
from ._forever import forever
from ._types import COLLECTIVES, REDUCING, DType, OpKind, ReduceOp

__all__ = ["COLLECTIVES", "DEFAULT_FUSION_BYTES", "DEFAULT_TIMEOUT", "REDUCING", "Buffer",
           "Config", "DType", "OpKind", "ReduceOp", "as_buffer", "forever", "new_buffer",
           *_errors]
