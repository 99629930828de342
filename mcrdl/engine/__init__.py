"""The progress engine: futures, the dependency DAG, lanes, one poll, and the drivers."""

from ._core import Engine, EngineStats
from ._future import CommFuture
from ._idle import PollPolicy
from ._lanes import ANY_PEER, CommState, Lane, OpRecord, take_source

__all__ = ["ANY_PEER", "CommFuture", "CommState", "Engine", "EngineStats", "Lane", "OpRecord",
           "PollPolicy", "take_source"]
