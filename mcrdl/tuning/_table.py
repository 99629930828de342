"""The tuning table: which backend to use per (operation, dtype, communicator size, size range).

A versioned JSON document that ``python -m mcrdl tune`` writes and ``init(tuning=...)`` (or
``MCRDL_TUNING``) reads. Every entry keeps the measured latencies of every candidate and the
margin of the winner, and the document carries its provenance (library versions, MPI library,
world size, host fingerprint, date) and a hash of its entries, which all ranks compare at
``init()``: the backend of a collective must be the same on every member (rule 4 of
docs/design.md), so every member must hold the same table.

Message size means the *global* size of the operation, the one nccl-tests reports: the buffer
of allreduce, broadcast, reduce and alltoall; the gathered whole of allgather and gather; the
scattered whole of scatter and reduce_scatter; the agreed total of alltoallv (the sum of every
rank's send counts). All of them are the same number on every member.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FORMAT", "Entry", "TuningTable"]

FORMAT = "mcrdl-tuning/1"


@dataclass(frozen=True)
class Entry:
    """One size range of one (op, dtype, comm_size): the backend that won it, and why.

    ``max_bytes`` is exclusive; None means no upper bound. ``latency_us`` maps every measured
    candidate to its median latency at ``measured_bytes`` (the size that decided the range);
    ``margin`` is the runner-up's latency over the winner's (1.0: a tie). ``device`` is the
    kind of device the buffers were on (``"cpu"``, ``"cuda"``): a choice measured on one
    kind says nothing about another.
    """

    op: str
    dtype: str
    comm_size: int
    min_bytes: int
    max_bytes: int | None
    backend: str
    latency_us: Mapping[str, float] = field(default_factory=dict)
    margin: float = 1.0
    measured_bytes: int = 0
    device: str = "cpu"


class TuningTable:
    """A loaded tuning table and the lookup ``backend="auto"`` uses.

    Invariants: for each (op, dtype, comm_size), the entries' ranges are sorted, contiguous
    from 0 and adjacent ranges name different backends (merged when the table is built).
    """

    def __init__(self, entries: Iterable[Entry], provenance: Mapping[str, Any] | None = None
                 ) -> None:
        self.entries = sorted(entries, key=lambda e: (e.device, e.op, e.dtype, e.comm_size,
                                                      e.min_bytes))
        self.provenance = dict(provenance or {})
        self._index: dict[tuple[str, str, str, int], tuple[list[int], list[str]]] = {}
        for e in self.entries:
            key = (e.op, e.dtype, e.device, e.comm_size)
            bounds, names = self._index.setdefault(key, ([], []))
            if names:
                bounds.append(e.min_bytes)
            names.append(e.backend)
        self._sizes: dict[tuple[str, str, str], list[int]] = {}
        for op, dtype, device, n in self._index:
            self._sizes.setdefault((op, dtype, device), []).append(n)
        for sizes in self._sizes.values():
            sizes.sort()
        self.hash = _hash(self.entries)

    # -- lookup --------------------------------------------------------------------------

    def route(self, op: str, dtype: str, comm_size: int, device: str = "cpu"
              ) -> tuple[list[int], list[str]] | None:
        """``(bounds, backends)`` for an (op, dtype) on buffers on ``device`` (a kind) on a
        communicator of ``comm_size``.

        The backend for ``nbytes`` is ``backends[bisect_right(bounds, nbytes)]``. A size the
        table did not measure uses the nearest measured one (the smaller on a tie), so the
        choice stays a function of rank-invariant facts. None: the table says nothing.
        """
        sizes = self._sizes.get((op, dtype, device))
        if not sizes:
            return None
        nearest = min(sizes, key=lambda s: (abs(s - comm_size), s))
        return self._index[(op, dtype, device, nearest)]

    def lookup(self, op: str, dtype: str, comm_size: int, nbytes: int,
               device: str = "cpu") -> str | None:
        """The backend the table chose, or None."""
        route = self.route(op, dtype, comm_size, device)
        if route is None:
            return None
        bounds, names = route
        return names[bisect_right(bounds, nbytes)]

    # -- files ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The document ``save`` writes."""
        return {"format": FORMAT, "provenance": self.provenance,
                "entries": [asdict(e) for e in self.entries], "hash": self.hash}

    def save(self, path: str) -> None:
        """Write the table as JSON."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh, indent=1, sort_keys=True)
            fh.write("\n")

    @classmethod
    def load(cls, path: str) -> TuningTable:
        """Read a table; its hash is checked against its entries.

        Raises:
            ValueError: not a tuning table of this format, or edited since it was written.
        """
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read tuning table {path}: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path} is not a tuning table of format {FORMAT}; "
                             "write one with: python -m mcrdl tune")
        table = cls((Entry(**e) for e in doc["entries"]), doc.get("provenance"))
        if doc.get("hash") != table.hash:
            raise ValueError(f"tuning table {path} does not match its hash (edited by hand?); "
                             "write a new one with: python -m mcrdl tune")
        return table

    @classmethod
    def from_measurements(
        cls,
        latencies: Mapping[tuple[str, str, int, int], Mapping[str, float]],
        provenance: Mapping[str, Any] | None = None,
        *,
        noise: float = 1.10,
        device: str = "cpu",
    ) -> TuningTable:
        """Build a table from ``{(op, dtype, comm_size, nbytes): {backend: µs}}``, measured
        on buffers on ``device`` (a kind: ``"cpu"``, ``"cuda"``).

        Each measured size decides the range from itself up to the next measured size (the
        first also covers everything below it); adjacent ranges with the same winner merge.
        A single size whose winner differs from both neighbours' (which agree) by less than
        ``noise`` (runner-up over winner) is taken for noise and given the neighbours' choice:
        one noisy point must not carve a range out for the slower backend.
        """
        groups: dict[tuple[str, str, int], list[tuple[int, Mapping[str, float]]]] = {}
        for (op, dtype, n, nbytes), lat in latencies.items():
            if lat:
                groups.setdefault((op, dtype, n), []).append((nbytes, lat))
        entries = []
        for (op, dtype, n), points in groups.items():
            points.sort(key=lambda p: p[0])
            winners = [min(lat.items(), key=lambda kv: (kv[1], kv[0]))[0] for _, lat in points]
            for i in range(1, len(points) - 1):
                lat = points[i][1]
                prev, nxt = winners[i - 1], winners[i + 1]
                if winners[i] != prev and prev == nxt and prev in lat:
                    if lat[prev] <= lat[winners[i]] * noise:
                        winners[i] = prev
            ranges: list[Entry] = []
            for i, (nbytes, lat) in enumerate(points):
                best = winners[i]
                best_us = lat[best]
                others = sorted(v for k, v in lat.items() if k != best)
                margin = others[0] / best_us if others and best_us > 0 else 1.0
                lo = 0 if i == 0 else nbytes
                hi = points[i + 1][0] if i + 1 < len(points) else None
                if ranges and ranges[-1].backend == best:
                    last = ranges[-1]
                    ranges[-1] = Entry(op, dtype, n, last.min_bytes, hi, best, last.latency_us,
                                       min(last.margin, margin), last.measured_bytes, device)
                else:
                    ranges.append(Entry(op, dtype, n, lo, hi, best,
                                        {k: round(v, 3) for k, v in lat.items()},
                                        round(margin, 3), nbytes, device))
            entries.extend(ranges)
        return cls(entries, provenance)


def _hash(entries: Iterable[Entry]) -> str:
    # (an entry on "cpu" hashes as before devices were recorded: older tables stay valid)
    canon = json.dumps([{k: v for k, v in asdict(e).items() if k != "device" or v != "cpu"}
                        for e in entries], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256((FORMAT + canon).encode()).hexdigest()
