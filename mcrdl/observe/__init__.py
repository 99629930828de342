"""Seeing what communication does: the comms log and its summary, the timeline trace, the
flight recorder and its explainer. Each is handed what it records (the engine's records, its
lanes); none reaches up into the runtime."""

from ._explain import explain, load_dumps
from ._flight import flight_dump, flight_record
from ._recorder import (
           Recorder,
           format_summary,
           plot_trace,
           summarize,
           summarize_trace,
           trace_events,
)

__all__ = ["Recorder", "explain", "flight_dump", "flight_record", "format_summary",
           "load_dumps", "plot_trace", "summarize", "summarize_trace", "trace_events"]
