"""The progress engine: futures, the dependency DAG, lanes, and the drivers that poll them."""

from ._drivers import PollPolicy
from ._future import CommFuture
from ._lanes import CommState, Lane, OpRecord
from ._progress import Engine, EngineStats

__all__ = ["CommFuture", "CommState", "Engine", "EngineStats", "Lane", "OpRecord", "PollPolicy"]
