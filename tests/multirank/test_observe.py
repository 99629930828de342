"""The comms log and trace in a real 2-rank run (launched by tests/test_multirank.py with
MCRDL_LOG=1 and MCRDL_TRACE set; the trace written at finalize is checked there)."""

from __future__ import annotations

import re

import pytest
import torch

import mcrdl

STEPS = 10


def test_logged_operations_give_the_same_results_and_are_summarized(world):
    n, r = world.size, world.rank
    for step in range(STEPS):
        with mcrdl.span("step"):
            x = torch.full((3000,), float(r + step))       # 12,000 B: the 16K bucket
            # Flow arrows gloo -> mpi -> gloo: an arrow is drawn for a dependency still
            # unfinished at submission, and the allreduce alone may finish before the
            # alltoall is submitted (the trace then had 19 arrows of 20 once); behind the
            # barrier (~0.1 ms of gloo) it is still pending when the alltoall comes.
            gate = world.barrier(backend="gloo")
            a = world.allreduce(x, backend="mpi", after=[gate])
            y = torch.arange(4 * n, dtype=torch.float32) + 100 * r
            b = world.alltoall(y, backend="gloo", after=[a])
            b.wait()
            assert torch.all(x == sum(range(n)) + n * step)
            want = torch.cat([torch.arange(4 * r, 4 * r + 4, dtype=torch.float32) + 100 * p
                              for p in range(n)])
            assert torch.equal(b.result(), want)
    text = world.log_summary()
    print(text)  # every rank gets the whole table
    rows = {(m[1], m[2], m[3]): m for m in re.finditer(
        r"^(\w+)\s+(\w+)\s+(\w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
        r"\s+([\d.]+)\s+(\d+) \(", text, re.M)}
    row = rows[("allreduce", "mpi", "16K")]
    assert int(row[4]) == STEPS, text
    mean_us, algbw, busbw = float(row[6]), float(row[9]), float(row[10])
    # The table prints 3 decimals: compare within them.
    assert algbw == pytest.approx(12000 / (mean_us * 1e-6) / 1e9, abs=0.0015, rel=0.01)
    assert busbw == pytest.approx(algbw * 2 * (n - 1) / n, abs=0.0015, rel=0.01)
    assert int(rows[("alltoall", "gloo", f"{16 * n}B")][4]) == STEPS, text  # n = 2 or 4
    assert int(row[11]) in range(n)




def test_summaries_leave_no_payloads_behind(world):
    """A summary every few steps: rank 0 deletes each gather's payloads once every member
    read them (the store grew by every record of every rank per summary)."""
    store = world.runtime.bootstrap.store()
    group = "-".join(map(str, world.members))
    for _ in range(4):
        world.allreduce(torch.ones(8)).wait()
        assert "allreduce" in world.log_summary()
    world.barrier().wait()
    if world.rank == 0:
        last = world.runtime.recorder._gathers[group]
        assert last >= 4
        old = [f"mcrdl/gather/{group}/{n}/{i}" for n in range(1, last)
               for i in range(world.size)]
        assert not any(store.check([k]) for k in old), [k for k in old if store.check([k])]
