"""Instructions and cache misses per operation, counted by valgrind: what timing cannot resolve.

    python benchmarks/footprint.py [--ops allreduce] [--calls raw,straight,seams,mcrdl]
                                   [--copy 4M] [--n 200]

Each call of ``benchmarks/floor.py`` (raw nb, straight, seams, mcrdl; one process, a
communicator of one rank) runs ``--n`` times under valgrind's callgrind with its cache
simulation, each time right after copying ``--copy`` bytes (0: with the caches warm), and
this prints, per operation: instructions, first-level misses (instruction and data) and
last-level misses (instruction fetch, data read, data write), all per call. The caches
simulated are this project's usual host's (L1i 32 KiB, L1d 48 KiB, last level 2 MiB, the
per-core L2). Only what runs inside the measured call is counted (callgrind's
``--toggle-collect`` on the C function of ``itertools.dropwhile`` that makes it).

The counts repeat to within a few per call between runs (``PYTHONHASHSEED=0``), where
timings on a 2-core host move by tenths of a microsecond: use it to compare two versions of
the hot path (the instructions it runs, and the lines it brings back into the caches after a
large message went through them: what makes the overhead grow with the message size,
docs/performance.md), and ``floor.py``/``overhead.py`` for what that is worth in time. Each
call costs a run of about two minutes (valgrind runs Python ~50x slower; importing torch
is most of it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from itertools import dropwhile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import parse_bytes  # noqa: E402

CALLS = ("raw", "straight", "seams", "mcrdl")
OPS = ("allreduce", "alltoall", "allgather", "broadcast", "reduce_scatter")
# The cache geometry simulated: size, associativity, line size.
_CACHES = ["--I1=32768,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"]
_EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


def _child(op: str, call_name: str, n: int, copy: int) -> None:
    """Under valgrind: warm ``call_name`` up, then run it ``n`` times inside dropwhile."""
    import numpy as np
    from common import op_buffers, raw_nonblocking
    from floor import seams_call_for, straight_call_for

    import mcrdl

    comm = mcrdl.init()
    from mpi4py import MPI

    raw_comm = MPI.COMM_WORLD.Dup()
    t, out = op_buffers(op, 4, 1)
    kwargs = {} if op in ("allreduce", "broadcast") else {"out": out}
    method = getattr(comm, op)
    straight = straight_call_for(MPI, raw_comm, op, 1)
    seams = seams_call_for(MPI, comm, op, 1)
    call = {"raw": raw_nonblocking(MPI, raw_comm, op, t, out),
            "straight": lambda: straight(t, out),
            "seams": lambda: seams(t, out),
            "mcrdl": lambda: method(t, backend="mpi", **kwargs).wait()}[call_name]
    src = np.ones(max(1, copy // 8))
    dst = np.empty_like(src)

    def one(_: object) -> None:  # (falsy: dropwhile yields the one item, and is done)
        call()

    for _ in range(200):
        one(0)
    for _ in range(n):
        if copy:
            np.copyto(dst, src)
        for _ in dropwhile(one, (0,)):  # counted: what runs inside dropwhile_next
            pass
    raw_comm.Free()
    mcrdl.finalize()


def _measure(op: str, call_name: str, n: int, copy: int) -> dict[str, float]:
    """Per call: the events of ``_EVENTS``, from a callgrind run of ``_child``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", *_CACHES,
               "--toggle-collect=dropwhile_next", f"--callgrind-out-file={out}",
               sys.executable, __file__, "--child", op, call_name, str(n), str(copy)]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"valgrind run of {call_name} {op} failed:\n{proc.stderr[-3000:]}")
        text = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True,
                              check=True).stdout
    events = re.search(r"^Events recorded:\s+(.*)$", text, re.M)
    totals = re.search(r"^\s*([\d,]+\s.*)PROGRAM TOTALS", text, re.M)
    if events is None or totals is None:
        raise RuntimeError(f"no totals in callgrind's output:\n{text[:2000]}")
    names = events.group(1).split()
    values = [int(v.replace(",", "")) for v in re.findall(r"([\d,]+) \(", totals.group(1))]
    counted = dict(zip(names, values))
    return {e: counted.get(e, 0) / n for e in _EVENTS}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="allreduce", help=f"comma-separated, of {','.join(OPS)}")
    ap.add_argument("--calls", default=",".join(CALLS), help=f"of {','.join(CALLS)}")
    ap.add_argument("--copy", default="4M", help="bytes copied before each call (0: none)")
    ap.add_argument("--n", type=int, default=200, help="calls counted per run")
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            ap.error(f"{tool} is not on PATH (Debian: apt install valgrind)")
    ops, calls = args.ops.split(","), args.calls.split(",")
    for name, given, known in (("--ops", ops, OPS), ("--calls", calls, CALLS)):
        for x in given:
            if x not in known:
                ap.error(f"{name}: {x!r} is not one of {', '.join(known)}")
    copy = parse_bytes(args.copy)
    print(f"# per call, counted by callgrind over {args.n} calls, each right after copying "
          f"{args.copy} bytes; caches simulated: L1i 32 KiB, L1d 48 KiB, last level 2 MiB")
    print(f"{'op':<14} {'call':<9} | {'instr':>8} | {'L1 i miss':>9} {'L1 d miss':>9} | "
          f"{'LL miss':>7} {'(instr':>7} {'d read':>7} {'d write)':>8}")
    for op in ops:
        for call_name in calls:
            c = _measure(op, call_name, args.n, copy)
            ll = c["ILmr"] + c["DLmr"] + c["DLmw"]
            print(f"{op:<14} {call_name:<9} | {c['Ir']:8.0f} | {c['I1mr']:9.0f} "
                  f"{c['D1mr'] + c['D1mw']:9.0f} | {ll:7.0f} {c['ILmr']:7.0f} "
                  f"{c['DLmr']:7.0f} {c['DLmw']:8.0f}", flush=True)


if __name__ == "__main__":
    main()
