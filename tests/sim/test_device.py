"""Device work ordered by events (docs/design.md rule 6), on the simulated device.

Each rank of the world has a simulated device (``mcrdl.testing._device``): streams that run
on their own, kernels that run some steps after they reach their stream's head, and
stream-ordered backends ("stream" semantics, as NCCL) whose collectives occupy their stream
until every member's has reached the head of theirs. The same engine code as a real run
orders the work: by the caller's stream at submission, by event waits between operations on
the device's streams (met when the first is queued), and by host-side gates for host lanes
(MPI, gloo) on device buffers.

The properties: generated programs that mix stream lanes and host lanes on device buffers,
the rank's own kernels, ``wait_stream``, named operations and faults, never hang and equal the
sequential reference. Then each rule is broken on purpose (``broken.py``) and the harness must
catch it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import mcrdl
from mcrdl.front._select import Selector
from mcrdl.testing import SimArray, SimDeadlock, SimMismatch, SimWorld, check_program, programs
from mcrdl.tuning import Entry, TuningTable

from . import examples
from .broken import (
    CopyBackIgnoredBackend,
    CopyInIgnoredBackend,
    HostOnEnqueueEngine,
    NoCallerEventEngine,
    NoStreamWaitEngine,
)

#: Two stream-ordered backends (two streams per communicator, so that operations on one
#: device depend on each other across streams) beside the two host ones.
DEVICE = {"mpi": "windowed", "gloo": "mpi", "nccl": "stream", "cupy": "stream"}

PROPERTY = settings(max_examples=examples(300), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@PROPERTY
@given(programs(backends=tuple(DEVICE), device=True), st.integers(0, 2**16))
def test_device_programs_never_deadlock_and_match_the_reference(program, seed):
    check_program(program, seed=seed, backends=DEVICE)


@settings(max_examples=examples(150), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(DEVICE), device=True, named=True), st.integers(0, 2**16))
def test_named_device_programs_match_the_reference(program, seed):
    """Concurrent blocks of named operations on stream lanes, each rank in its own order."""
    check_program(program, seed=seed, backends=DEVICE)


@settings(max_examples=examples(150), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(DEVICE), device=True, max_faults=1, min_faults=1,
                max_size=4), st.integers(0, 2**16))
def test_device_programs_with_a_fault_stay_in_step(program, seed):
    """Rule 7 on stream lanes: one rank's operation fails or is cancelled; no wrong data."""
    check_program(program, seed=seed, backends=DEVICE)


# -- host backends that do not reach the device: staged through host copies ----------------

#: MPI without CUDA support, gloo, and a backend of blocking calls, beside a stream backend:
#: the runtime stages the first three's operations on device buffers (`backends._staging`).
STAGED_SEMS = {"mpi": "windowed", "gloo": "mpi", "ccl": "blocking", "nccl": "stream"}
STAGED = ("mpi", "gloo", "ccl")


@settings(max_examples=examples(50), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(STAGED_SEMS), device=True), st.integers(0, 2**16))
def test_staged_device_programs_never_deadlock_and_match_the_reference(program, seed):
    check_program(program, seed=seed, backends=STAGED_SEMS, staged=STAGED)


@settings(max_examples=examples(30), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(STAGED_SEMS), device=True, named=True), st.integers(0, 2**16))
def test_staged_named_device_programs_match_the_reference(program, seed):
    check_program(program, seed=seed, backends=STAGED_SEMS, staged=STAGED)


@settings(max_examples=examples(60), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(STAGED_SEMS), device=True, max_faults=1, min_faults=1,
                max_size=4), st.integers(0, 2**16))
def test_staged_device_programs_with_a_fault_stay_in_step(program, seed):
    check_program(program, seed=seed, backends=STAGED_SEMS, staged=STAGED)


# -- host backends that reach the device for all but their reductions (CUDA-aware MPI) ----

#: A CUDA-aware MPI and a backend of blocking calls that get device buffers as they are, but
#: run their reductions in host memory (staged), beside a staged one and a stream backend.
DIRECT_SEMS = {"mpi": "windowed", "gloo": "mpi", "ccl": "blocking", "nccl": "stream"}
DIRECT = ("mpi", "ccl")


@settings(max_examples=examples(30), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(DIRECT_SEMS), device=True), st.integers(0, 2**16))
def test_direct_device_programs_never_deadlock_and_match_the_reference(program, seed):
    check_program(program, seed=seed, backends=DIRECT_SEMS, direct=DIRECT, staged=("gloo",))


@settings(max_examples=examples(40), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(backends=tuple(DIRECT_SEMS), device=True, max_faults=1, min_faults=1,
                max_size=4), st.integers(0, 2**16))
def test_direct_device_programs_with_a_fault_stay_in_step(program, seed):
    check_program(program, seed=seed, backends=DIRECT_SEMS, direct=DIRECT, staged=("gloo",))


# -- the harness catches each rule broken ------------------------------------------------

#: The first failing program is enough (shrinking one costs minutes here).
SEARCH = settings(max_examples=600, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def _caught(engine, backends, max_steps, **world):
    sems = {k: v for k, v in DEVICE.items() if k in backends or k == "gloo"}
    if "staging" in world:  # the host backends stage their device buffers
        world["staged"] = [k for k, v in sems.items() if v != "stream"]

    def fails(program):
        for seed in range(3):
            try:
                check_program(program, seed=seed, backends=sems, engine_factory=engine,
                              **world)
            except (SimDeadlock, SimMismatch, AssertionError, mcrdl.MCRDLError):
                return True
        return False

    program = find(programs(backends=backends, device=True, auto=False, max_steps=max_steps,
                            min_size=2, max_size=2, max_splits=0,
                            kinds=("allreduce", "allgather", "broadcast", "alltoall",
                                   "sendrecv")),
                   fails, settings=SEARCH)
    print(f"{(engine or world['staging']).__name__}: caught with {len(program.steps)} step(s):")
    for step in program.steps:
        print(f"  {step}")
    # the real engine and staging get it right
    check_program(program, seed=0, backends=sems, staged=world.get("staged", ()))


def test_missing_event_wait_between_streams_is_caught():
    _caught(NoStreamWaitEngine, ("nccl", "cupy"), 5)


def test_ignoring_the_callers_stream_is_caught():
    _caught(NoCallerEventEngine, ("mpi", "nccl"), 4)


def test_host_lane_going_on_at_enqueue_is_caught():
    _caught(HostOnEnqueueEngine, ("mpi", "nccl"), 5)


def test_a_host_call_before_the_copy_from_the_device_is_caught():
    _caught(None, ("mpi", "nccl"), 4, staging=CopyInIgnoredBackend)


def test_finishing_before_the_copy_back_is_caught():
    _caught(None, ("mpi", "nccl"), 4, staging=CopyBackIgnoredBackend)


# -- the rules, one by one ----------------------------------------------------------------

def _run(program, size=2, **world):
    return SimWorld(size, DEVICE, **world).run(program)


def _device(comm):
    return comm.runtime.devices["simgpu:0"]


def test_a_dependency_between_streams_is_met_when_the_first_is_queued():
    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(4, comm.rank + 1.0))
        if comm.rank == 1:
            # Rank 1's nccl stream is busy for a while, so that the allreduce on it runs
            # late; rank 1's cupy operation reads other bytes and can run at once.
            dev.launch(lambda: None, stream=comm._slots["nccl"].lane.stream, steps=30)
        first = comm.allreduce(x, backend="nccl")
        y = x if comm.rank == 0 else dev.array(np.full(4, 100.0))
        second = comm.allreduce(y, backend="cupy")  # on rank 0, reads what first writes
        # Issued at once, its stream waiting on first's event: no host wait in between.
        states = (first.state, second.state, second.event is not None)
        second.wait()
        first.wait()
        return states, np.array(y)

    zero, one = _run(program)
    assert zero[0] == one[0] == ("ISSUED", "ISSUED", True)
    assert list(zero[1]) == list(one[1]) == [103.0] * 4  # rank 0's (1 + 2), then + 100


def test_a_host_lane_waits_for_the_device_operation_to_run():
    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(4, comm.rank + 1.0))
        if comm.rank == 1:  # the nccl allreduce runs late (its stream busy on rank 1)
            dev.launch(lambda: None, stream=comm._slots["nccl"].lane.stream, steps=30)
        gate = comm.barrier(backend="mpi")
        first = comm.allreduce(x, backend="nccl", after=[gate])
        second = comm.allreduce(x, backend="mpi")  # reads what first writes
        gate.wait()  # first is queued on its stream now; second must wait for it to run
        seen = (first.state, second.state)
        second.wait()
        return seen, first.done(), np.array(x)

    for seen, first_done, x in _run(program):
        assert seen == ("ISSUED", "PENDING") and first_done
        assert list(x) == [6.0] * 4


def test_operations_read_their_input_after_the_callers_kernels():
    def program(comm):
        dev = _device(comm)
        x = dev.array(np.zeros(4))

        def kernel():
            x[:] = comm.rank + 1

        dev.launch(kernel, steps=5)
        on_stream = comm.allreduce(x, backend="nccl")
        y = dev.array(np.zeros(4))

        def kernel2():
            y[:] = comm.rank + 10

        dev.launch(kernel2, steps=5)
        gated = comm.allreduce(y, backend="mpi")  # a host lane: gated on the kernel's event
        state = gated.state
        on_stream.wait()
        gated.wait()
        return state, np.array(x), np.array(y)

    for state, x, y in _run(program):
        assert state == "PENDING"
        assert list(x) == [3.0] * 4 and list(y) == [21.0] * 4


def test_wait_stream_does_not_block_the_host():
    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(4, comm.rank + 1.0))
        fut = comm.allreduce(x, backend="nccl")
        fut.wait_stream()  # the current stream waits for it; the host goes on
        done_then = fut.done()
        out = dev.array(np.zeros(4))

        def consume():
            out[:] = x * 10

        dev.launch(consume)
        dev.synchronize()
        return done_then, np.array(out)

    for done_then, out in _run(program):
        assert not done_then
        assert list(out) == [30.0] * 4


def test_wait_stream_on_a_host_operation_waits_for_it():
    def program(comm):
        x = _device(comm).array(np.full(4, comm.rank + 1.0))
        fut = comm.allreduce(x, backend="mpi")
        fut.wait_stream()
        return fut.done()

    assert _run(program) == [True, True]


def test_a_failure_on_a_stream_fails_what_went_on_behind_it():
    world = SimWorld(2, DEVICE)

    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(4, 1.0))
        if comm.rank == 0:
            world.inject("error", [x])
        first = comm.allreduce(x, backend="nccl")
        second = comm.allreduce(x, backend="cupy")
        issued = second.state
        errors = []
        for fut in (first, second):
            try:
                fut.wait()
                errors.append(None)
            except mcrdl.MCRDLError as exc:
                errors.append(type(exc).__name__)
        return issued, errors

    got = world.run(program)
    # Rank 0's second operation went on before the first failed there: it fails, and since
    # its peer matched it with what rank 0 did not produce, the communicator breaks.
    assert got[0] == ("ISSUED", ["BackendError", "DependencyFailedError"])
    assert got[1] == ("ISSUED", [None, "CommBrokenError"])


# -- selection by device ---------------------------------------------------------------------

def test_the_device_is_part_of_every_choice():
    def program(comm):
        host = comm.allreduce(np.ones(4))
        dev = comm.allreduce(_device(comm).array(np.ones(4)))
        return host.lane.backend_name, dev.lane.backend_name, sorted(
            {key[-1] for key in comm._choice_cache})

    for host, dev, devices in _run(program):
        assert host == "mpi"  # the preference for host memory
        assert dev in ("cupy", "nccl")  # a stream-ordered backend first for device memory
        assert devices == ["cpu", "simgpu:0"]


def test_a_backend_that_cannot_reach_the_buffer_says_which_can():
    def program(comm):
        with pytest.raises(mcrdl.UnsupportedOperationError,
                           match=r"nccl cannot reach cpu .*backends that can: mpi, gloo"):
            comm.allreduce(np.ones(4), backend="nccl")
        x = _device(comm).array(np.ones(4))
        with pytest.raises(ValueError, match="out is on cpu but buf is on simgpu:0"):
            comm.allgather(x, out=np.empty(8))
        return True

    assert _run(program) == [True, True]


def test_no_backend_reaching_the_device():
    def program(comm):
        x = np.ones(4).view(SimArray)
        x._device = "simgpu:0"  # memory of a device no backend of this world reaches
        with pytest.raises(mcrdl.UnsupportedOperationError,
                           match="no backend in this runtime can allreduce float64 with SUM "
                                 "on simgpu:0"):
            comm.allreduce(x)
        return True

    assert SimWorld(2, {"mpi": "windowed"}).run(program) == [True, True]


def test_a_runtime_needs_a_backend_of_host_memory():
    with pytest.raises(mcrdl.BackendUnavailableError, match="reach device memory only"):
        SimWorld(2, {"nccl": "stream"})


def test_an_alltoallv_routed_by_size_on_device_buffers():
    """A tuning table keyed by the simulated device splits alltoallv by its agreed total
    between a stream lane and a host lane; the data is written by the rank's own kernel just
    before (the routed operation waits on the host for its event, then goes where the total
    says), and read back by a kernel after ``wait_stream``."""
    entries = [Entry("alltoallv", "float64", 2, 0, 64, "nccl", device="simgpu"),
               Entry("alltoallv", "float64", 2, 64, None, "mpi", device="simgpu"),
               Entry("alltoallv", "float64", 2, 0, None, "gloo")]  # (cpu: another choice)

    def selector(rank, backends):
        return Selector(backends, table=TuningTable(entries))

    def program(comm):
        dev = _device(comm)
        x = dev.array(np.zeros(6))

        def fill():
            x[:] = np.arange(6.0) + 10 * comm.rank

        dev.launch(fill, steps=40)  # (longer than the exchange of the counts)
        counts = [2, 4] if comm.rank == 0 else [5, 1]
        large = comm.alltoallv(x, counts)  # 96 B in all -> mpi
        small = comm.alltoallv(x[:2], [1, 1])  # 32 B in all -> nccl
        small.wait_stream()  # its output is made when the counts are in: a host wait
        assert small.done()
        got = dev.array(np.zeros(2))
        out = small.result()

        def copy():
            got[:] = out

        dev.launch(copy)
        dev.synchronize()
        return (large.wait().tolist(), large.lane.backend_name, np.array(got).tolist(),
                small.lane.backend_name)

    world = SimWorld(2, DEVICE, seed=5, selector_factory=selector)
    zero, one = world.run(program)
    assert zero == ([0.0, 1.0, 10.0, 11.0, 12.0, 13.0, 14.0], "mpi", [0.0, 10.0], "nccl")
    assert one == ([2.0, 3.0, 4.0, 5.0, 15.0], "mpi", [1.0, 11.0], "nccl")


# -- staging, one by one ----------------------------------------------------------------

def _staged_run(program, way="staged", **world):
    """``program`` on two ranks whose mpi and gloo reach the device ``way``: ``"staged"``
    (through host copies) or ``"direct"`` (as they are, but for their reductions)."""
    return SimWorld(2, {"mpi": "windowed", "gloo": "mpi"}, device=True,
                    **{way: ("mpi", "gloo")}, **world).run(program)


@pytest.mark.parametrize(("way", "staged", "direct"), [("staged", ["simgpu"], []),
                                                       ("direct", [], ["simgpu"])])
def test_a_staged_or_direct_backend_says_so_in_its_capabilities(way, staged, direct):
    def program(comm):
        caps = comm.runtime.backend("mpi").capabilities
        return sorted(caps.devices), sorted(caps.staged), sorted(caps.direct)

    assert _staged_run(program, way) == [(["cpu", "simgpu"], staged, direct)] * 2


def test_a_staged_operation_reads_after_the_callers_kernel_and_returns_on_the_device():
    def program(comm):
        dev = _device(comm)
        x = dev.array(np.zeros(4))

        def fill():
            x[:] = comm.rank + 1

        dev.launch(fill, steps=20)
        out = comm.allgather(x, backend="gloo").wait()
        y = dev.array(np.full(3, 10.0 * (comm.rank + 1)))
        comm.allreduce(y, backend="mpi").wait()  # in place: copied in, and back
        return type(out).__name__, out.device, out.tolist(), y.tolist()

    for kind, device, out, y in _staged_run(program):
        assert (kind, device) == ("SimArray", "simgpu:0")
        assert out == [1.0] * 4 + [2.0] * 4 and y == [30.0] * 3


def test_host_calls_keep_the_order_the_engine_started_them_in():
    """A send of host memory behind a send of device memory on the same lane: its host call
    waits until the first one's is made (the copy from the device runs late), or the
    receiver would match them the other way round."""

    def program(comm):
        dev = _device(comm)
        if comm.rank == 0:
            dev.launch(lambda: None, steps=30)  # the caller's stream busy: x's gate opens late
            x = dev.array(np.full(2, 1.0))
            first = comm.send(x, 1, backend="mpi")
            dev.synchronize()  # now x's send is started; its copy takes some steps more
            second = comm.send(np.full(2, 2.0), 1, backend="mpi")
            first.wait()
            second.wait()
            return None
        a, b = np.zeros(2), np.zeros(2)
        comm.recv(a, 0, backend="mpi").wait()
        comm.recv(b, 0, backend="mpi").wait()
        return a.tolist(), b.tolist()

    for seed in range(4):
        assert _staged_run(program, seed=seed, max_delay=6)[1] == ([1.0, 1.0], [2.0, 2.0])


def test_a_buffer_on_another_device_of_a_kind_the_runtime_reaches_is_refused():
    def program(comm):
        x = _device(comm).array(np.ones(4))
        x._device = "simgpu:1"  # (a second GPU of the process: the runtime has only the first)
        with pytest.raises(ValueError, match=r"a buffer is on simgpu:1, but this runtime "
                                             r"reaches simgpu:0 \(the GPU current at init\(\)\)"):
            comm.allreduce(x, backend="nccl")
        return comm.allreduce(_device(comm).array(np.ones(2)), backend="nccl").wait().tolist()

    assert _run(program) == [[2.0, 2.0]] * 2


# -- a host backend reaching the device for all but its reductions (CUDA-aware MPI) --------

def test_device_buffers_go_as_they_are_and_reductions_are_staged():
    """A direct backend's allgather sees the device arrays themselves; its allreduce (host
    only) sees host copies, and the result is back on the device."""

    def program(comm):
        dev = _device(comm)
        inner = comm.runtime.backend("mpi").inner
        seen = []
        for name in ("start_allgather", "start_allreduce"):
            real = getattr(inner, name)

            def probe(group, *args, _real=real, _name=name):
                seen.append((_name, args[0].device))
                return _real(group, *args)

            setattr(inner, name, probe)
        x = dev.array(np.full(2, comm.rank + 1.0))
        dev.launch(lambda: x.__setitem__(slice(None), 10.0 * (comm.rank + 1)), steps=20)
        out = comm.allgather(x, backend="mpi").wait()
        comm.allreduce(x, backend="mpi").wait()
        return seen, out.device, out.tolist(), x.device, x.tolist()

    for seen, out_device, out, x_device, x in _staged_run(program, "direct"):
        assert seen == [("start_allgather", "simgpu:0"), ("start_allreduce", "cpu")]
        assert out_device == x_device == "simgpu:0"
        assert out == [10.0, 10.0, 20.0, 20.0] and x == [30.0, 30.0]


def test_an_operation_handed_over_as_it_is_waits_behind_a_staged_one():
    """On a lane with no issue window, an allgather of device memory (handed over as it is)
    started while the allreduce before it (staged: a host-only reduction) waits for its copy
    from the device: its host call waits too, or the members would match them the other way
    round."""

    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(2, comm.rank + 1.0))
        y = dev.array(np.full(2, 10.0 * (comm.rank + 1)))
        if comm.rank == 0:  # the staging's copy stream busy: x's copy in runs late
            staging = comm.runtime.backend("gloo")
            dev.launch(lambda: None, stream=staging._stream(dev), steps=40)
        first = comm.allreduce(x, backend="gloo")
        if comm.rank == 1:
            first.wait()  # rank 1's host calls are in order whatever the adapter does
        second = comm.allgather(y, backend="gloo")
        return first.wait().tolist(), second.wait().tolist()

    for seed in range(6):
        got = _staged_run(program, "direct", seed=seed, max_delay=6)
        assert got == [([3.0, 3.0], [10.0, 10.0, 20.0, 20.0])] * 2


def test_a_name_on_host_memory_here_and_device_memory_there_is_a_desync():
    """Whether a named operation's buffers are in device memory is part of its signature:
    fusion (host memory only) must be decided alike on every member, so a name given host
    memory on one rank and device memory on another fails with DesyncError (or
    CommBrokenError naming it) on both, where it used to agree."""
    def program(comm):
        x = np.ones(4) if comm.rank == 0 else _device(comm).array(np.ones(4))
        with pytest.raises((mcrdl.DesyncError, mcrdl.CommBrokenError)) as info:
            comm.allreduce(x, backend="mpi", name="g").wait()
        return str(info.value)

    for text in _run(program):
        assert "in device memory" in text, text
