"""The front: ``init()``, the `Runtime` it makes, and the `Communicator` users call, which
checks each call, picks its backend and hands it to the engine."""

from ._communicator import Communicator
from ._process import current_runtime, finalize, init, span
from ._runtime import Runtime
from ._select import Selector
from ._taskcheck import TaskOrderWarning

__all__ = ["Communicator", "Runtime", "Selector", "TaskOrderWarning", "current_runtime",
           "finalize", "init", "span"]
