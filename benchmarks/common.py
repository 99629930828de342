"""Helpers shared by the benchmarks: size ranges, human-readable byte counts, paired timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"4"``, ``"64K"``, ``"16M"`` -> bytes."""
    text = text.strip().upper().rstrip("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    number = text[: len(text) - len(unit)]
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a byte count like 4, 64K or 16M") from None


def parse_sizes(spec: str, base: int = 4) -> list[int]:
    """``"4:64M"`` -> [4, 16, 64, ..., 64M] (powers of ``base``); ``"1K,1M"`` -> those two."""
    if "," in spec:
        return [parse_bytes(s) for s in spec.split(",")]
    lo, _, hi = spec.partition(":")
    lo_b, hi_b = parse_bytes(lo), parse_bytes(hi or lo)
    if lo_b <= 0 or hi_b < lo_b:
        raise ValueError(f"size range {spec!r} must read lo:hi with 0 < lo <= hi")
    sizes, s = [], lo_b
    while s <= hi_b:
        sizes.append(s)
        s *= base
    return sizes


def human(nbytes: int) -> str:
    """4 -> '4B', 65536 -> '64K', 1 << 20 -> '1M'."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def timed(call: Callable[[], object], reps: int, sync: Callable[[], object]) -> list[float]:
    """Seconds of each of ``reps`` calls, ``sync()`` (a barrier) before each, not timed."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def alternate(call_a: Callable[[], object], call_b: Callable[[], object], iters: int,
              sync: Callable[[], object] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of each call of A and of B, timed alternately: A-B, then B-A.

    Both see the same machine (it drifts here), and neither always runs second: whichever
    does pays for the first's leftovers (gloo finishes bookkeeping on its threads after
    ``wait()`` returns, and the peer rank may still be in its previous call). ``sync``: a
    barrier run before every call, untimed (the shape of a training step: compute, then the
    first collective, with the ranks arriving together and the caches holding other data).
    """
    a: list[float] = []
    b: list[float] = []
    clock = time.perf_counter
    for i in range(iters):
        first, second, fa, fb = (call_a, call_b, a, b) if i % 2 == 0 else (call_b, call_a, b, a)
        if sync is not None:
            sync()
        t0 = clock()
        first()
        t1 = clock()
        if sync is not None:
            sync()
            t1b = clock()
        else:
            t1b = t1
        second()
        t2 = clock()
        fa.append(t1 - t0)
        fb.append(t2 - t1b)
    return a, b


def host() -> str:
    """The CPU model, core count and cache sizes (``lscpu``): figures move between hosts."""
    import os
    import subprocess

    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    caches = ", ".join(f"{k} {fields[k]}" for k in ("L1d cache", "L2 cache", "L3 cache")
                       if k in fields)
    return (f"{fields.get('Model name', 'unknown CPU')}, {os.cpu_count()} cores"
            + (f" ({caches})" if caches else ""))


def mpi_target(nbytes: int) -> str:
    """The overhead target for mcrdl's ``.wait()`` over mpi against raw nb at ``nbytes``, as
    text: ``+4us`` (<= 4 KiB), ``+5us`` (to 256 KiB), ``0.9x`` (from 1 MiB), ``0.95x`` (from
    4 MiB)."""
    if nbytes <= 4096:
        return "+4us"
    if nbytes < 1 << 20:
        return "+5us"
    return "0.95x" if nbytes >= 4 << 20 else "0.9x"


def meets_mpi_target(nbytes: int, raw_s: float, call_s: float) -> bool:
    """Whether a call taking ``call_s`` seconds meets `mpi_target` against raw nb's
    ``raw_s``."""
    target = mpi_target(nbytes)
    if target.endswith("us"):
        return (call_s - raw_s) * 1e6 <= float(target[1:-2])
    return raw_s / call_s >= float(target[:-1])


def op_buffers(op: str, nbytes: int, n: int) -> tuple[Any, Any]:
    """``op``'s input tensor of about ``nbytes`` and its output (every rank's share whole), for
    a communicator of ``n`` ranks. Inputs of sums are zeros: they stay finite however often
    they run."""
    import torch

    elems = max(1, nbytes // 4)
    if op in ("alltoall", "reduce_scatter"):
        elems = max(n, elems // n * n)
    t = torch.ones(elems, dtype=torch.float32)
    if op in ("allreduce", "reduce_scatter"):
        t.zero_()
    out_elems = {"allgather": elems * n, "reduce_scatter": elems // n}.get(op, elems)
    return t, torch.empty(out_elems, dtype=torch.float32)


def raw_nonblocking(MPI: Any, comm: Any, op: str, t: Any,  # noqa: N803
                    out: Any) -> Callable[[], None]:
    """raw nb: mpi4py's nonblocking ``op`` on ``comm``, on numpy views of ``t`` and ``out``
    made once, then its ``Test`` loop (the floor of any nonblocking engine)."""
    a, o, in_place = t.numpy(), out.numpy(), MPI.IN_PLACE
    start = {
        "allreduce": lambda: comm.Iallreduce(in_place, a),
        "alltoall": lambda: comm.Ialltoall(a, o),
        "allgather": lambda: comm.Iallgather(a, o),
        "broadcast": lambda: comm.Ibcast(a, 0),
        "reduce_scatter": lambda: comm.Ireduce_scatter_block(a, o),
    }[op]

    def call() -> None:
        req = start()
        while not req.Test():
            pass

    return call
