"""mcrdl.torch's ``Work`` on device tensors keeps torch's stream semantics, on the simulated
device.

ProcessGroupNCCL's ``Work.wait()`` makes the caller's current stream wait for the collective
and lets the host go on; ``async_op=False`` is that wait; whatever torch queues afterwards on
the stream (DDP's bucket copies, the adapter's own copies into torch's tensors) sees the
result. The adapter's ``Work`` does the same through ``CommFuture.wait_stream``. Its copies
(``then``) are device work too: here they are kernels on the simulated device, queued on the
current stream as torch's copies are on CUDA.

Each case runs under several seeds: the seed decides how long each rank's kernels and
streams take, so a ``Work`` that skips the stream's wait reads stale values in some of them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip("torch")

from mcrdl.testing import SimWorld  # noqa: E402
from mcrdl.torch._group import _Work  # noqa: E402

#: A stream-ordered backend (as NCCL) and a host one that does not reach the device (staged
#: through host copies, as gloo is on a GPU).
BACKENDS = {"nccl": "stream", "gloo": "mpi"}
SEEDS = range(8)


def _device(comm):
    return comm.runtime.devices["simgpu:0"]


def _copy(dst, src, scale=1.0):
    """A kernel body: ``dst[:] = src * scale``."""
    def body():
        dst[:] = np.asarray(src) * scale
    return body


def _program(backend):
    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(4, comm.rank + 1.0))
        copied = dev.array(np.zeros(4))
        later = dev.array(np.zeros(4))
        # then: the adapter's copies into torch's tensors, queued behind the collective
        work = _Work([comm.allreduce(x, backend=backend)], [],
                     lambda: dev.launch(_copy(copied, x)))
        assert work.wait() is True
        finished_at_return = work.is_completed()
        dev.launch(_copy(later, x, 10.0))  # the caller's next kernel on its current stream
        dev.synchronize()
        return finished_at_return, list(copied), list(later), work.is_success()
    return program


@pytest.mark.parametrize("seed", SEEDS)
def test_wait_orders_the_current_stream_and_the_host_goes_on(seed):
    got = SimWorld(2, BACKENDS, device=True, seed=seed).run(_program("nccl"))
    for _, copied, later, success in got:
        assert copied == [3.0] * 4 and later == [30.0] * 4
        assert success
    # The host waited only until the collective was queued on its stream: on at least one
    # rank it returned before the collective had run (the other rank's was queued later).
    assert not all(finished for finished, *_ in got)


@pytest.mark.parametrize("seed", SEEDS)
def test_wait_on_a_staged_host_operation_waits_for_it(seed):
    got = SimWorld(2, BACKENDS, device=True, staged=("gloo",), seed=seed).run(_program("gloo"))
    for finished_at_return, copied, later, success in got:
        assert finished_at_return  # it ran on the host: wait() is the host's wait
        assert copied == [3.0] * 4 and later == [30.0] * 4 and success


def test_a_failure_found_after_wait_fails_the_work_and_what_depends_on_it():
    world = SimWorld(2, BACKENDS, device=True)

    def program(comm):
        dev = _device(comm)
        x = dev.array(np.full(4, 1.0))
        if comm.rank == 0:
            world.inject("error", [x])
        work = _Work([comm.allreduce(x, backend="nccl")], [])
        returned = work.wait()  # the failure is on the stream, not known yet
        try:  # the caller's next operation on the same tensor
            comm.allreduce(x, backend="nccl").wait()
            after = None
        except Exception as exc:  # noqa: BLE001 - what the next operation raises
            after = type(exc).__name__
        dev.synchronize()
        with contextlib.suppress(Exception):  # until the failure is known here
            work._futs[0].wait()
        return returned, work.is_success(), type(work.exception()).__name__, after

    got = world.run(program)
    assert got[0] == (True, False, "BackendError", "DependencyFailedError")
    # Rank 1's first allreduce ran; its second was matched with nothing on rank 0.
    assert got[1] == (True, True, "NoneType", "CommBrokenError")
