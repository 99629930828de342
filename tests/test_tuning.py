"""The tuning table and backend="auto": building, files, hashes, routing, fallbacks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np
import pytest

from mcrdl import DType, OpKind, ReduceOp
from mcrdl.backends import Capabilities
from mcrdl.core._config import Config
from mcrdl.front._runtime import Runtime
from mcrdl.front._select import Router, Selector
from mcrdl.tuning import Entry, TuningTable
from mcrdl.tuning._table import FORMAT
from tests.manual_backend import ManualBackend

MEASURED = {
    ("allreduce", "float32", 2, 4): {"mpi": 2.0, "gloo": 200.0},
    ("allreduce", "float32", 2, 1024): {"mpi": 3.0, "gloo": 210.0},
    ("allreduce", "float32", 2, 1 << 20): {"mpi": 500.0, "gloo": 400.0},
    ("allreduce", "float32", 2, 4 << 20): {"mpi": 2000.0, "gloo": 1500.0},
    ("allreduce", "float32", 4, 4): {"mpi": 20.0, "gloo": 900.0},
    ("alltoall", "float32", 2, 4): {"mpi": 3.0, "gloo": 2.9},   # a near tie...
    ("alltoall", "float32", 2, 64): {"mpi": 3.0, "gloo": 100.0},
    ("alltoall", "float32", 2, 1024): {"mpi": 3.0, "gloo": 2.95},  # ...a noisy point...
    ("alltoall", "float32", 2, 4096): {"mpi": 3.0, "gloo": 100.0},  # ...between agreeing ones
}


def test_ranges_are_built_merged_and_carry_their_measurements():
    t = TuningTable.from_measurements(MEASURED, {"world_size": 2})
    ar = [e for e in t.entries if e.op == "allreduce" and e.comm_size == 2]
    assert [(e.min_bytes, e.max_bytes, e.backend) for e in ar] == [
        (0, 1 << 20, "mpi"), (1 << 20, None, "gloo")]
    assert ar[0].latency_us == {"mpi": 2.0, "gloo": 200.0}
    assert ar[0].margin == pytest.approx(70.0)  # min over the merged points: 210 / 3
    assert ar[1].measured_bytes == 1 << 20


def test_a_single_noisy_point_does_not_carve_a_range():
    t = TuningTable.from_measurements(MEASURED)
    a2a = [(e.min_bytes, e.max_bytes, e.backend) for e in t.entries if e.op == "alltoall"]
    # the first point is a real (if small) win at the edge; 1024 B is noise between mpi wins
    assert a2a == [(0, 64, "gloo"), (64, None, "mpi")]


def test_lookup_at_the_boundaries_and_the_nearest_communicator_size():
    t = TuningTable.from_measurements(MEASURED)
    assert t.lookup("allreduce", "float32", 2, 0) == "mpi"
    assert t.lookup("allreduce", "float32", 2, (1 << 20) - 1) == "mpi"
    assert t.lookup("allreduce", "float32", 2, 1 << 20) == "gloo"
    assert t.lookup("allreduce", "float32", 2, 1 << 30) == "gloo"
    assert t.lookup("allreduce", "float32", 3, 8) == "mpi"  # 2 and 4 tie: the smaller
    assert t.lookup("allreduce", "bfloat16", 2, 8) is None


def test_save_load_round_trip_and_the_hash(tmp_path):
    t = TuningTable.from_measurements(MEASURED, {"world_size": 2, "date": "2026-11-30"})
    path = tmp_path / "t.json"
    t.save(str(path))
    again = TuningTable.load(str(path))
    assert again.hash == t.hash and again.entries == t.entries
    assert again.provenance["date"] == "2026-11-30"
    doc = json.loads(path.read_text())
    doc["entries"][0]["backend"] = "gloo"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"does not match its hash \(edited by hand\?\)"):
        TuningTable.load(str(path))
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match=r"is not a tuning table of format mcrdl-tuning/1"):
        TuningTable.load(str(path))


def _runtime(table, size=2, mpi_caps=None):
    caps = mpi_caps or Capabilities(
        ops=frozenset(OpKind), dtypes=frozenset(DType),
        reductions={op: frozenset(DType) - {DType.BFLOAT16}
                    for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)})
    backends = {"mpi": ManualBackend(name="mpi", size=size, capabilities=caps),
                "gloo": ManualBackend(name="gloo", size=size)}
    return Runtime(Config(progress_thread=False), None, backends,
                   selector=Selector(("mpi", "gloo"), table=table))


def test_auto_routes_every_call_by_global_size():
    runtime = _runtime(TuningTable.from_measurements(MEASURED))
    comm = runtime.world
    small = comm.allreduce(np.ones(4, dtype=np.float32))
    large = comm.allreduce(np.ones(1 << 18, dtype=np.float32))  # 1 MiB
    assert small.lane.backend_name == "mpi" and large.lane.backend_name == "gloo"
    assert type(comm._choice_cache[(OpKind.ALLREDUCE, DType.FLOAT32, ReduceOp.SUM, None, "cpu")]) \
        is Router
    explicit = comm.allreduce(np.ones(1 << 18, dtype=np.float32), backend="mpi")
    assert explicit.lane.backend_name == "mpi"
    runtime.engine.fail_all(lambda f: RuntimeError("done"))


def test_selection_is_a_pure_function_of_the_facts():
    table = TuningTable.from_measurements(MEASURED)
    picks = set()
    for _ in range(3):
        runtime = _runtime(table)
        choice = runtime.selector.choose(runtime.world._slots, OpKind.ALLREDUCE,
                                         DType.FLOAT32, ReduceOp.SUM, None, 2)
        picks.add(choice.pick(1 << 20)[0].backend.name)
        runtime.engine.fail_all(lambda f: RuntimeError("done"))
    assert picks == {"gloo"}


def test_capability_fallback_when_the_table_names_a_backend_that_cannot():
    entries = [Entry("allreduce", "bfloat16", 2, 0, None, "mpi")]
    runtime = _runtime(TuningTable(entries))
    import torch

    fut = runtime.world.allreduce(torch.ones(4, dtype=torch.bfloat16))
    assert fut.lane.backend_name == "gloo"  # mpi cannot reduce bfloat16 here
    runtime.engine.fail_all(lambda f: RuntimeError("done"))


def test_a_table_naming_a_backend_that_is_not_up_falls_back():
    entries = [Entry("allreduce", "float32", 2, 0, None, "nccl")]
    runtime = _runtime(TuningTable(entries))
    fut = runtime.world.allreduce(np.ones(4, dtype=np.float32))
    assert fut.lane.backend_name == "mpi"
    runtime.engine.fail_all(lambda f: RuntimeError("done"))


def test_the_table_is_keyed_by_device():
    cpu = Entry("allreduce", "float32", 2, 0, None, "mpi")
    cuda = Entry("allreduce", "float32", 2, 0, None, "nccl", device="cuda")
    t = TuningTable([cpu, cuda])
    assert t.lookup("allreduce", "float32", 2, 8) == "mpi"
    assert t.lookup("allreduce", "float32", 2, 8, device="cuda") == "nccl"
    assert t.lookup("allreduce", "float32", 2, 8, device="simgpu") is None
    # an entry on cpu hashes as it did before devices were recorded (older tables stay valid)
    before = [{k: v for k, v in asdict(cpu).items() if k != "device"}]
    canon = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert TuningTable([cpu]).hash == hashlib.sha256((FORMAT + canon).encode()).hexdigest()
    assert t.hash != TuningTable([cpu, Entry("allreduce", "float32", 2, 0, None, "nccl",
                                             device="simgpu")]).hash


def test_measurements_on_a_device_make_entries_for_that_device():
    t = TuningTable.from_measurements(MEASURED, device="cuda")
    assert {e.device for e in t.entries} == {"cuda"}
    both = TuningTable([*TuningTable.from_measurements(MEASURED).entries, *t.entries])
    for op, dtype, n, nbytes in MEASURED:
        assert (both.lookup(op, dtype, n, nbytes, device="cuda")
                == both.lookup(op, dtype, n, nbytes) is not None)
