"""Measuring backends and choosing among them: sweeps, the tuning table, reports.

- `TuningTable`: which backend ``backend="auto"`` uses per (operation, dtype, communicator
  size, global message size), with the measurements that decided it; ``init(tuning=PATH)``
  or ``MCRDL_TUNING`` loads one, and every rank checks it holds the same (hash).
- ``python -m mcrdl bench``: sweeps operations x sizes x dtypes x backends (and raw mpi4py /
  torch.distributed), printed as nccl-tests or OSU tables, CSV, JSON or a PNG plot.
- ``python -m mcrdl tune``: the same sweep, written as a tuning table.
"""

from ._table import FORMAT, Entry, TuningTable

__all__ = ["FORMAT", "Entry", "TuningTable"]
