"""A real runtime in a plain ``python`` process: a world of one, on the real mpi and gloo backends."""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
import torch

import mcrdl
from mcrdl import CommClosedError, MCRDLError, ReduceOp, UnknownBackendError
from mcrdl.bootstrap._launch import detect_launcher
from mcrdl.core._config import Config


@pytest.fixture
def world():
    comm = mcrdl.init(timeout=60)
    yield comm
    mcrdl.finalize()


def test_world_of_one(world):
    assert (world.rank, world.size) == (0, 1)
    assert world.backends == ("mpi", "gloo")
    assert repr(world) == "<Communicator world rank=0/1 backends=mpi,gloo>"
    assert mcrdl.current_runtime() is world.runtime


def test_mpi_says_which_memory_it_reaches(world):
    mpi = world.runtime.backend("mpi")
    # MPI 4.1's mpi_memory_alloc_kinds, read from the library (MPICH's wheel: "mpi,system")
    assert "system" in mpi.memory_kinds
    # and MPIX_Query_cuda_support(), found in the library mpi4py loaded (MPICH has it)
    assert mpi.cuda_support is not None
    assert mpi.cuda_aware == (any(k.startswith("cuda") for k in mpi.memory_kinds)
                              or mpi.cuda_support)
    assert mpi.capabilities.devices == {"cpu"}  # a device's buffers reach it staged or direct
    assert mpi.capabilities.direct == ({"cuda"} if mpi.cuda_aware else set())


@pytest.mark.parametrize("backend", ["mpi", "gloo", None])
def test_every_op_on_one_rank(world, backend):
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    assert world.allreduce(x.clone(), backend=backend).wait().tolist() == x.tolist()
    assert world.allreduce(x.clone(), ReduceOp.AVG, backend=backend).wait().tolist() == x.tolist()
    assert world.reduce(x.clone(), backend=backend).wait().tolist() == x.tolist()
    assert world.broadcast(x.clone(), backend=backend).wait().tolist() == x.tolist()
    assert world.allgather(x, backend=backend).wait().tolist() == x.tolist()
    assert world.gather(x, backend=backend).wait().tolist() == x.tolist()
    assert world.scatter(x, backend=backend).wait().tolist() == x.tolist()
    assert world.reduce_scatter(x, backend=backend).wait().tolist() == x.tolist()
    assert world.alltoall(x, backend=backend).wait().tolist() == x.tolist()
    assert world.alltoallv(x, [3], backend=backend).wait().tolist() == x.tolist()
    assert world.alltoallv(x, [3], [3], backend=backend).wait().tolist() == x.tolist()
    assert world.barrier(backend=backend).wait() is None
    a = np.arange(4, dtype=np.int64)
    assert world.allgather(a, backend=backend).wait().tolist() == [0, 1, 2, 3]


_KEEPALIVE_OPS = {
    "allreduce": lambda c, x, b: c.allreduce(x, backend=b),
    "broadcast": lambda c, x, b: c.broadcast(x, backend=b),
    "reduce": lambda c, x, b: c.reduce(x, backend=b),
    "gather": lambda c, x, b: c.gather(x, backend=b),
    "allgather": lambda c, x, b: c.allgather(x, backend=b),
    "scatter": lambda c, x, b: c.scatter(x, backend=b),
    "reduce_scatter": lambda c, x, b: c.reduce_scatter(x, backend=b),
    "alltoall": lambda c, x, b: c.alltoall(x, backend=b),
    "alltoallv": lambda c, x, b: c.alltoallv(x, [x.numel()], [x.numel()], backend=b),
    "alltoallv exchanging counts": lambda c, x, b: c.alltoallv(x, [x.numel()], backend=b),
}


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_an_operation_in_flight_keeps_its_buffers_alive(backend):
    """The caller may drop its buffers at once (``comm.alltoall(x.clone())``): the backend
    still reads and writes their memory (MPI by address) until the operation finishes, so
    the runtime keeps them alive until then, and no longer."""
    with mcrdl.init(timeout=60, progress_thread=False) as comm:
        for name, submit in _KEEPALIVE_OPS.items():
            # 4 MiB: long enough to copy that gloo's thread is still at it when checked here.
            x = torch.arange(1 << 20, dtype=torch.float32)
            ref = weakref.ref(x)
            fut = submit(comm, x, backend)
            del x
            deadline = time.monotonic() + 30
            while fut.state == "PENDING" and time.monotonic() < deadline:
                comm.runtime.engine.poll()  # alltoallv issues once its counts arrived
            gc.collect()
            assert fut.state == "ISSUED", f"{name} is {fut.state}: nothing to check"
            assert ref() is not None, f"{name}: its input was released while in flight"
            fut.wait()
            del fut
            gc.collect()
            assert ref() is None, f"{name}: the runtime still holds its input after it finished"


def test_with_statement_finalizes():
    with mcrdl.init() as comm:
        fut = comm.allreduce(torch.ones(2))
    assert fut.done() and fut.result().tolist() == [1.0, 1.0]
    assert comm.runtime.finalized and mcrdl.current_runtime() is None
    with pytest.raises(CommClosedError, match=r"^cannot barrier on world: the runtime was finalized$"):
        comm.barrier()
    mcrdl.finalize()  # idempotent, and a no-op without a live runtime


def test_a_process_alone_in_its_mpi_world_exits_without_the_alarm_after_failures():
    """After operations failed, the exit arms an alarm that bounds MPI_Finalize, which can
    wait for a peer that never comes; a process alone in its MPI world has none, and exits
    as usual (before, every single-process program, the test runner included, printed the
    warning and ran MPI_Finalize under the alarm)."""
    code = ("import mcrdl, mcrdl.front._runtime as r; mcrdl.init(backends='mpi'); "
            "r._unhealthy = True")  # (what finalize sets once an operation failed)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "MPI_Finalize has" not in proc.stderr, proc.stderr


def test_init_twice_is_refused_and_reinit_after_finalize_works():
    mcrdl.init()
    try:
        with pytest.raises(MCRDLError, match=r"^mcrdl is initialized already"):
            mcrdl.init()
    finally:
        mcrdl.finalize()
    comm2 = mcrdl.init(backends="gloo")
    try:
        assert comm2.backends == ("gloo",)
        assert comm2.allreduce(torch.ones(1)).wait().item() == 1.0
    finally:
        mcrdl.finalize()


def test_init_from_a_given_store():
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"init\(store=, rank=, world_size=\) go together.*rank=None"):
        mcrdl.init(store=dist.HashStore())
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        mcrdl.init(store=dist.HashStore(), rank=2, world_size=2)
    assert mcrdl.current_runtime() is None
    comm = mcrdl.init(store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert comm.backends == ("gloo",) and comm.size == 1
        assert comm.allreduce(torch.ones(2)).wait().tolist() == [1.0, 1.0]
    finally:
        mcrdl.finalize()


def test_unknown_backend_at_init():
    with pytest.raises(UnknownBackendError, match=r"^unknown backend 'glo'; known: cupy-nccl, gloo, mpi, nccl, sim$"):
        mcrdl.init(backends=["glo"])
    assert mcrdl.current_runtime() is None


def test_split_on_one_rank(world):
    sub = world.split(3)
    assert (sub.rank, sub.size, sub.name) == (0, 1, "world.1c3")
    assert world.split(None) is None
    sub.close()
    sub.close()  # idempotent


def test_closed_communicators_leave_nothing_in_the_engine(world):
    """A loop that splits and closes a communicator per step: the engine forgets each closed
    one and its lanes (their timeouts and flight records included), and a named operation's
    state goes with it."""
    engine = world.runtime.engine
    sub = world.split(0)
    sub.allreduce(np.ones(2), name="g").wait()
    sub.close()
    comms, lanes = len(engine._comms), len(engine.lanes())
    for _ in range(20):
        sub = world.split(0)
        sub.allreduce(np.ones(2), name="g").wait()
        sub.allreduce(np.ones(2)).wait()
        sub.close()
    assert (len(engine._comms), len(engine.lanes())) == (comms, lanes)
    assert {lane.comm.name for lane in engine.lanes()} == {"world"}


def test_launcher_detection():
    assert detect_launcher({}) == "single"
    assert detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2"}) == "mpi"
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert detect_launcher({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}) == "torchrun"


def test_config_from_environment_and_arguments():
    env = {"MCRDL_TIMEOUT": "12.5", "MCRDL_DEBUG": "1", "MCRDL_BACKENDS": "gloo, mpi",
           "MCRDL_PROGRESS_THREAD": "0"}
    c = Config.load(environ=env)
    assert (c.timeout, c.debug, c.backends, c.progress_thread) == (12.5, True, ("gloo", "mpi"), False)
    assert Config.load(environ=env, timeout=None).timeout is None
    assert Config.load(environ={"MCRDL_TIMEOUT": "none"}).timeout is None
    with pytest.raises(ValueError, match=r"^MCRDL_TIMEOUT='soon' is not a number of seconds$"):
        Config.load(environ={"MCRDL_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match=r"^MCRDL_DEBUG='maybe' is not a boolean; use 1 or 0$"):
        Config.load(environ={"MCRDL_DEBUG": "maybe"})
    assert not Config.load(environ={}).check_tasks
    assert Config.load(environ={"MCRDL_CHECK_TASKS": "1"}).check_tasks
    assert not Config.load(environ={"MCRDL_CHECK_TASKS": "1"}, check_tasks=False).check_tasks
    assert Config.load(environ={}).fusion_bytes == 1 << 20
    assert Config.load(environ={"MCRDL_FUSION_BYTES": "0"}).fusion_bytes == 0
    assert Config.load(environ={"MCRDL_FUSION_BYTES": "0"}, fusion_bytes=4096).fusion_bytes == 4096
    with pytest.raises(ValueError, match=r"^MCRDL_FUSION_BYTES='1M' is not a number of bytes$"):
        Config.load(environ={"MCRDL_FUSION_BYTES": "1M"})
    with pytest.raises(ValueError, match=r"^fusion_bytes=-1 must be a non-negative number of "
                                         r"bytes \(0: off\)$"):
        Config.load(fusion_bytes=-1)
    assert Config.load(environ={}).peer_timeout == 10.0
    assert Config.load(environ={"MCRDL_PEER_TIMEOUT": "3"}).peer_timeout == 3.0
    for bad in ("0", "0.5"):
        with pytest.raises(ValueError, match=rf"^MCRDL_PEER_TIMEOUT='{bad}' must be at least 1 "
                                             r"second \(the kernel's keep-alive probes count "
                                             r"whole seconds\)$"):
            Config.load(environ={"MCRDL_PEER_TIMEOUT": bad})


def test_check_tasks_gives_every_communicator_the_task_check():
    from mcrdl.front._taskcheck import TaskCheck

    for on in (False, True):
        with mcrdl.init(check_tasks=on) as comm:
            check = comm.runtime.task_check
            assert isinstance(check, TaskCheck) if on else check is None
            assert comm._task_check is check and comm.split(0)._task_check is check


def test_import_initializes_nothing():
    code = ("import sys, mcrdl; "
            "print(sorted(m for m in ('torch', 'mpi4py.MPI', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


PUBLIC = [
    "BackendError", "BackendUnavailableError", "CommBrokenError",
    "CommClosedError",
    "CommFuture", "CommTimeoutError", "Communicator", "DType", "DependencyFailedError",
    "DesyncError", "EngineStats", "FutureCancelledError", "InvalidStateError", "MCRDLError",
    "OpKind", "PeerLostError", "ReduceOp", "Runtime", "RuntimeFinalizedError", "StartError",
    "TaskOrderWarning",
    "UnknownBackendError",
    "UnsupportedOperationError", "current_runtime", "finalize", "init", "span",
]


def test_public_surface_is_pinned_and_documented():
    import mcrdl.backends
    import mcrdl.engine

    assert sorted(mcrdl.__all__) == sorted(PUBLIC)
    for module in (mcrdl, mcrdl.engine, mcrdl.backends):
        assert module.__doc__
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__doc__, f"{module.__name__}.{name} has no docstring"
                for attr, member in vars(obj).items() if inspect.isclass(obj) else []:
                    if not attr.startswith("_") and inspect.isfunction(member):
                        assert member.__doc__, f"{module.__name__}.{name}.{attr} has no docstring"


def test_an_abandoned_mpi_group_is_never_freed(world):
    """A broken communicator's MPI communicator stays allocated for the rest of the process:
    freed, its context id could go to a communicator made later, where a message that an
    abandoned operation sent could be matched (MPIBackend.abandon)."""
    mpi = world.runtime.backend("mpi")
    group = mpi.create_group(mpi.world(), [0], "abandoned")
    comm = group.comm
    mpi.abandon(group)
    mpi.free_group(group)
    assert comm.Get_size() == 1  # still a live communicator (freed, it would be COMM_NULL)


@pytest.mark.parametrize("module, name", [("mcrdl.engine._breaks", "_ABANDONED"),
                                          ("mcrdl.backends.mpi", "_KEPT")])
def test_what_is_kept_for_the_rest_of_the_process_outlives_the_interpreters_teardown(
        module, name):
    """The zombies an engine abandons and the MPI communicators of broken groups are kept
    for the rest of the process: MPI_Finalize, which mpi4py runs from ``Py_AtExit`` after the
    interpreter's teardown, may still move an abandoned operation's bytes. Kept in plain
    module-level lists, they were deallocated by that teardown, before MPI_Finalize (a
    weakref callback, itself never dropped, reports a deallocation at any point of the
    exit)."""
    code = "\n".join([
        "import importlib, os, weakref",
        "from mcrdl.core._forever import forever",
        f"kept = getattr(importlib.import_module({module!r}), {name!r})",
        "class Held: pass",
        "obj = Held()",
        "forever(weakref.ref(obj, lambda _r, w=os.write: w(1, b'freed')))",
        "kept.append((obj, 0.0))",
        "del obj, kept",
        "print('exiting', flush=True)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["exiting"], out.stdout


def test_a_sweep_runs_where_its_buffers_can_be(world):
    from mcrdl.tuning._bench import sweep

    points = sweep(world, ["allreduce"], [64], ["float32"], ["mpi"], raw=False, budget=0.001,
                   warmup=1)
    assert [(p.backend, p.device) for p in points] == [("mpi", "cpu")]
    with pytest.raises(ValueError, match="device='tpu': sweeps run on 'cpu' or 'cuda'"):
        sweep(world, ["allreduce"], [64], ["float32"], ["mpi"], device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda', but torch sees no CUDA device"):
            sweep(world, ["allreduce"], [64], ["float32"], ["mpi"], device="cuda")


def test_the_runtime_gives_the_engine_the_thread_nap_of_its_node(monkeypatch):
    """One rank fills a one-core node: the background thread's longest nap is 4 ms there,
    and the default (None: no doubling) where a core is left for it
    (`_runtime._poll_policy`)."""
    for cores, nap in ((1, 4e-3), (64, None)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        with mcrdl.init() as comm:
            assert comm.runtime.bootstrap is not None and comm.runtime.bootstrap.local_size == 1
            assert comm.runtime.engine.policy.background_nap_max == nap
