"""How sweeps are shown: nccl-tests tables, OSU latency listings, CSV, JSON and a PNG plot."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

from ._bench import Point

__all__ = ["as_csv", "as_json", "as_osu", "as_table", "plot"]

_TYPES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
          "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8"}


def _groups(points: Sequence[Point]) -> dict[tuple[str, str], list[Point]]:
    """Points by (op, what they ran on): the dtype, and the device unless it is the CPU."""
    out: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        out.setdefault((p.op, _on(p)), []).append(p)
    return out


def _on(p: Point) -> str:
    return p.dtype if p.device == "cpu" else f"{p.dtype} on {p.device}"


def as_table(points: Sequence[Point], ranks: int) -> str:
    """nccl-tests' layout: one row per size and backend, time in µs, algbw and busbw in GB/s."""
    lines = []
    for (op, dtype), pts in _groups(points).items():
        lines.append(f"#\n# {op}, {dtype}, {ranks} ranks (busbw factor as in nccl-tests)")
        lines.append(f"# {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}"
                     f" {'time':>10} {'algbw':>8} {'busbw':>8}  backend")
        lines.append(f"# {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5}"
                     f" {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
        for p in sorted(pts, key=lambda p: (p.nbytes, p.backend)):
            lines.append(f"  {p.nbytes:>12} {p.count:>12} {_TYPES.get(p.dtype, p.dtype):>8}"
                         f" {p.redop:>6} {p.root:>5} {p.time_us:>10.2f} {p.algbw:>8.3f}"
                         f" {p.busbw:>8.3f}  {p.backend}")
    return "\n".join(lines)


def as_osu(points: Sequence[Point]) -> str:
    """The OSU micro-benchmarks' listing: ``# Size  Latency (us)`` per op, dtype and backend."""
    lines = []
    by: dict[tuple[str, str, str], list[Point]] = {}
    for p in points:
        by.setdefault((p.op, _on(p), p.backend), []).append(p)
    for (op, dtype, backend), pts in by.items():
        lines.append(f"# mcrdl {op.capitalize()} Latency Test ({dtype}, {backend})")
        lines.append(f"# {'Size':<10} {'Latency (us)':>14}")
        for p in sorted(pts, key=lambda p: p.nbytes):
            lines.append(f"{p.nbytes:<12} {p.time_us:>14.2f}")
        lines.append("")
    return "\n".join(lines)


def as_csv(points: Sequence[Point]) -> str:
    """One row per point, with a header."""
    buf = io.StringIO()
    fields = list(points[0].as_dict()) if points else []
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for p in points:
        writer.writerow(p.as_dict())
    return buf.getvalue()


def as_json(points: Sequence[Point], meta: dict[str, Any]) -> str:
    """``{"meta": ..., "points": [...]}``."""
    return json.dumps({"meta": meta, "points": [p.as_dict() for p in points]}, indent=1)


def plot(points: Sequence[Point], path: str, title: str) -> None:
    """A PNG: per operation, latency and busbw against size, one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups([p for p in points if p.nbytes > 0])
    if not groups:
        raise ValueError("nothing to plot: no point with a non-zero size")
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for row, ((op, dtype), pts) in enumerate(groups.items()):
        backends = sorted({p.backend for p in pts})
        for backend in backends:
            mine = sorted((p for p in pts if p.backend == backend), key=lambda p: p.nbytes)
            xs = [p.nbytes for p in mine]
            axes[row][0].plot(xs, [p.time_us for p in mine], marker="o", ms=3, label=backend)
            axes[row][1].plot(xs, [p.busbw for p in mine], marker="o", ms=3, label=backend)
        for col, ylabel in enumerate(("latency (µs)", "busbw (GB/s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            if col == 0:
                ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op} {dtype}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
