"""mcrdl: a mix-and-match communication runtime for distributed deep learning.

One API over several communication backends (MPI through mpi4py, torch.distributed gloo),
where every operation may run on a different backend in one program, without deadlocks.
Every operation returns a `CommFuture` at once; ``await`` it in asyncio code or ``.wait()``
for it in ordinary code::

    import mcrdl

    with mcrdl.init() as comm:
        y = comm.alltoall(x).wait()
        comm.allreduce(grad, backend="gloo")

``import mcrdl`` initializes nothing: MPI, torch.distributed and threads start in `init`.
"""

from .core._errors import (
    BackendError,
    BackendUnavailableError,
    CommBrokenError,
    CommClosedError,
    CommTimeoutError,
    DependencyFailedError,
    DesyncError,
    FutureCancelledError,
    InvalidStateError,
    MCRDLError,
    PeerLostError,
    RuntimeFinalizedError,
    StartError,
    UnknownBackendError,
    UnsupportedOperationError,
)
from .core._types import DType, OpKind, ReduceOp
from .engine import CommFuture, EngineStats
from .front._communicator import Communicator
from .front._process import current_runtime, finalize, init, span
from .front._runtime import Runtime
from .front._taskcheck import TaskOrderWarning

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "CommBrokenError",
    "CommClosedError",
    "CommFuture",
    "CommTimeoutError",
    "Communicator",
    "DType",
    "DependencyFailedError",
    "DesyncError",
    "EngineStats",
    "FutureCancelledError",
    "InvalidStateError",
    "MCRDLError",
    "OpKind",
    "PeerLostError",
    "ReduceOp",
    "Runtime",
    "RuntimeFinalizedError",
    "StartError",
    "TaskOrderWarning",
    "UnknownBackendError",
    "UnsupportedOperationError",
    "current_runtime",
    "finalize",
    "span",
    "init",
]
