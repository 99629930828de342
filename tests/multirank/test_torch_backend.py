"""mcrdl as a torch.distributed backend ("mcrdl"), at 2 and 4 ranks under mpiexec: torch's
collectives through dist.*, subgroups, backend pins, DDP against a reference computed without
communication, DDP mixed with the program's own comm.* calls, and the error paths."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import mcrdl
import mcrdl.torch

BACKENDS = ["mpi", "gloo", None]


@pytest.fixture(scope="module", autouse=True)
def pg():
    """mcrdl first (mcrdl.torch.init_process_group(), under mpiexec), or, with
    MCRDL_TORCH_FIRST=1, torch first: dist.init_process_group("mcrdl") from torch's env://
    store (under torchrun), mcrdl coming up from it."""
    if os.environ.get("MCRDL_TORCH_FIRST") == "1":
        dist.init_process_group("mcrdl")
    else:
        mcrdl.torch.init_process_group()
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()
    mcrdl.finalize()


def _need(*backends):
    missing = set(backends) - set(mcrdl.torch.communicator().backends) - {None}
    if missing:
        pytest.skip(f"{sorted(missing)} not up under this launcher")


def _ran_on(comm, fn):
    """Run ``fn``; the backends whose lanes of ``comm`` finished operations meanwhile."""
    before = {name: len(slot.lane.history) + slot.lane.submitted
              for name, slot in comm._slots.items()}
    fn()
    return {name for name, slot in comm._slots.items()
            if len(slot.lane.history) + slot.lane.submitted != before[name]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_of_every_kind(backend):
    _need(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    with mcrdl.torch.backend(backend):
        t = torch.full((5,), float(r + 1))
        dist.all_reduce(t)
        assert t.tolist() == [n * (n + 1) / 2] * 5
        for op, want in ((dist.ReduceOp.MAX, n), (dist.ReduceOp.MIN, 1),
                         (dist.ReduceOp.PRODUCT, float(torch.arange(1, n + 1).prod())),
                         (dist.ReduceOp.AVG, (n + 1) / 2)):
            t = torch.full((3,), float(r + 1))
            dist.all_reduce(t, op=op)
            assert t.tolist() == pytest.approx([want] * 3), op
        bits = torch.tensor([1 << r, 3, 1 << r], dtype=torch.int64)  # rank r sets bit r
        everyone = (1 << n) - 1
        for op, want in ((dist.ReduceOp.BAND, [0, 3, 0]), (dist.ReduceOp.BOR, [everyone, 3, everyone]),
                         (dist.ReduceOp.BXOR, [everyone, 3 * (n % 2), everyone])):
            t = bits.clone()
            dist.all_reduce(t, op=op)
            assert t.tolist() == want, op
        # AVG on integers: a sum, then a division truncating toward zero (as torch's NCCL).
        t = torch.tensor([r, -r, 7], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        half = n * (n - 1) // 2
        assert t.tolist() == [half // n, -(half // n), 7]
        t = torch.tensor([r + 1], dtype=torch.int32)
        dist.reduce(t, dst=0, op=dist.ReduceOp.AVG)
        assert t.tolist() == [(n * (n + 1) // 2) // n if r == 0 else r + 1]
        premul = dist._make_nccl_premul_sum(0.5)
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t, op=premul)
        assert t.tolist() == [n * (n + 1) / 4] * 2
        src = torch.arange(2.0 * n)
        o = torch.empty(2)
        dist.reduce_scatter_single(o, src, op=dist._make_nccl_premul_sum(torch.tensor([2.0])))
        assert o.tolist() == [4.0 * n * r, 2.0 * n * (2 * r + 1)]
        assert src.tolist() == list(map(float, range(2 * n)))  # the input is left alone
        t = torch.full((2,), float(r))
        dist.broadcast(t, src=n - 1)
        assert t.tolist() == [n - 1.0] * 2
        t = torch.full((2,), float(r + 1))
        dist.reduce(t, dst=1)
        if r == 1:
            assert t.tolist() == [n * (n + 1) / 2] * 2
        outs = [torch.empty(2, 3) for _ in range(n)]
        dist.all_gather(outs, torch.full((2, 3), float(r)))
        assert [o[0, 0].item() for o in outs] == list(map(float, range(n)))
        out = torch.empty(n, 2)
        dist.all_gather_single(out, torch.full((2,), float(r)))
        assert out[:, 0].tolist() == list(map(float, range(n)))
        o = torch.empty(2)
        dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(n)])
        assert o.tolist() == [float(n * r + n * (n - 1) / 2)] * 2
        o = torch.empty(3)
        dist.reduce_scatter_single(o, torch.arange(3.0 * n))
        assert o.tolist() == [float(n * (3 * r + i)) for i in range(3)]
        # uneven all_to_all_single: rank r sends i + 1 rows to rank i (and receives r + 1
        # rows from everybody)
        send = [i + 1 for i in range(n)]
        recv = [r + 1] * n
        inp = torch.arange(float(sum(send))) + 100 * r
        out = torch.empty(sum(recv))
        dist.all_to_all_single(out, inp, recv, send)
        want = []
        for src in range(n):
            at = sum(range(1, r + 1))
            want += [100.0 * src + at + k for k in range(r + 1)]
        assert out.tolist() == want
        out = torch.empty(2 * n)
        dist.all_to_all_single(out, torch.arange(2.0 * n) + 10 * r)
        assert out.tolist() == [10.0 * src + 2 * r + k for src in range(n) for k in range(2)]
        ins = [torch.full((i + 1,), float(r)) for i in range(n)]
        outs = [torch.empty(r + 1) for _ in range(n)]
        dist.all_to_all(outs, ins)
        assert [o.tolist() for o in outs] == [[float(src)] * (r + 1) for src in range(n)]
        gathered = [torch.empty(2) for _ in range(n)] if r == 0 else None
        dist.gather(torch.full((2,), float(r)), gathered, dst=0)
        if r == 0:
            assert [g[0].item() for g in gathered] == list(map(float, range(n)))
        o = torch.empty(2)
        dist.scatter(o, [torch.full((2,), float(i)) for i in range(n)] if r == 0 else None, src=0)
        assert o.tolist() == [float(r)] * 2
        dist.barrier()
        if r == 0:
            dist.send(torch.tensor([7.0, 8.0]), dst=1, tag=3)
        elif r == 1:
            z = torch.zeros(2)
            dist.recv(z, src=0, tag=3)
            assert z.tolist() == [7.0, 8.0]
        right, left = (r + 1) % n, (r - 1) % n
        inbox = torch.zeros(1)
        ops = [dist.P2POp(dist.irecv, inbox, left), dist.P2POp(dist.isend, torch.tensor([float(r)]), right)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert inbox.item() == float(left)
        objs = [None] * n
        dist.all_gather_object(objs, {"rank": r})
        assert objs == [{"rank": i} for i in range(n)]
        box = [{"from": r}]
        dist.broadcast_object_list(box, src=n - 1)
        assert box == [{"from": n - 1}]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.int8])
def test_every_cpu_dtype_allreduces(dtype):
    t = torch.full((4,), 2, dtype=dtype)
    dist.all_reduce(t)
    assert t.tolist() == [2 * dist.get_world_size()] * 4


def test_async_work_and_its_future():
    n = dist.get_world_size()
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert fut.wait()[0] is t and t.tolist() == [float(n)] * 3
    chained = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2)
    assert chained.wait().tolist() == [2.0 * n] * 2


def test_coalesced_calls():
    n = dist.get_world_size()
    a, b = torch.ones(2), torch.ones(3)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert a.tolist() == [float(n)] * 2 and b.tolist() == [float(n)] * 3
    outs = [torch.empty(2 * n), torch.empty(n)]
    with dist._coalescing_manager():
        dist.all_gather_single(outs[0], torch.full((2,), 1.0))
        dist.all_gather_single(outs[1], torch.full((1,), 2.0))
    assert outs[0].tolist() == [1.0] * 2 * n and outs[1].tolist() == [2.0] * n


def test_a_subgroup_and_a_device_mesh():
    r, n = dist.get_rank(), dist.get_world_size()
    members = list(range(0, n, 2)) if n > 2 else [0, 1]
    group = dist.new_group(members)
    if r in members:
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(sum(members))] * 2
        assert mcrdl.torch.communicator(group).size == len(members)
    if n % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        t = torch.full((1,), float(r))
        dist.all_reduce(t, group=mesh.get_group("tp"))
        row = [i for i in range(n) if i // (n // 2) == r // (n // 2)]
        assert t.item() == float(sum(row))


def test_one_group_serves_cpu_and_cuda(pg):
    """Registered for both devices, as torch's default groups serve both: torch's default for
    cuda stays nccl; the group is its own backend for each (torch asks for it after
    ``init_process_group(device_id=...)``, which DeepSpeed passes on CUDA, and needs it not
    to split); object collectives run on CPU."""
    assert dist.Backend.backend_capability["mcrdl"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    for device in ("cpu", "cuda", "cuda:1"):
        backend = pg._get_backend(torch.device(device))
        assert backend is pg and not backend.supports_splitting
        assert not backend.supports_tensor_alloc(torch.device(device))
    with pytest.raises(RuntimeError, match="serves cpu, cuda"):
        pg._get_backend(torch.device("xpu"))
    assert dist.distributed_c10d._get_object_coll_device() == "cpu"


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_groups_of_every_rank_are_independent(backend):
    """Two groups of all the ranks, all-reduced in opposite orders on odd and even ranks:
    each collective meets its own group's (groups sharing one communicator would match
    them across groups and exchange the wrong data)."""
    _need(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    g1, g2 = dist.new_group(), dist.new_group()
    a, b = torch.full((4,), r + 1.0), torch.full((4,), 100.0 * (r + 1))
    order = [(g1, a), (g2, b)] if r % 2 == 0 else [(g2, b), (g1, a)]
    with mcrdl.torch.backend(backend):
        works = [dist.all_reduce(t, group=g, async_op=True) for g, t in order]
    for w in works:
        w.wait()
    total = n * (n + 1) / 2
    assert a.tolist() == [total] * 4 and b.tolist() == [100 * total] * 4


def test_destroying_a_group_releases_its_communicator():
    """dist.destroy_process_group(g) closes g's communicator: new_group, a collective and
    destroy in a loop leave the runtime's communicators, the engine's lanes and the threads
    as they were (before, each cycle kept a communicator with its gloo threads and sockets)."""
    import threading

    runtime = mcrdl.torch.communicator().runtime
    t = torch.ones(4)
    g = dist.new_group(list(range(dist.get_world_size())))
    dist.all_reduce(t, group=g)
    dist.destroy_process_group(g)
    before = (len(runtime._comms), len(runtime.engine.lanes()), threading.active_count())
    comms = []
    for _ in range(5):
        g = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(t, group=g)
        comms.append(mcrdl.torch.communicator(g))
        dist.destroy_process_group(g)
    assert all(c.closed for c in comms)
    assert (len(runtime._comms), len(runtime.engine.lanes()), threading.active_count()) == before


def test_pins_choose_the_backend():
    _need("mpi", "gloo")
    comm = mcrdl.torch.communicator()
    t = torch.ones(4)
    with mcrdl.torch.backend("gloo"):
        assert _ran_on(comm, lambda: dist.all_reduce(t)) == {"gloo"}
    mcrdl.torch.set_backend(None, "mpi")
    try:
        assert _ran_on(comm, lambda: dist.all_reduce(t)) == {"mpi"}
        with mcrdl.torch.backend("gloo"):  # the region wins over the group
            assert _ran_on(comm, lambda: dist.all_reduce(t)) == {"gloo"}
    finally:
        mcrdl.torch.set_backend(None, None)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(n, steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * n, 6, generator=g), torch.randn(4 * n, 3, generator=g))
            for _ in range(steps)]


def _reference(n, steps):
    """The same training on the whole batch, in one process: what DDP must reproduce."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(n, steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def _pinned(backend):
    """The default group's collectives on ``backend`` for the block."""
    mcrdl.torch.set_backend(None, backend)
    try:
        yield
    finally:
        mcrdl.torch.set_backend(None, None)


def _train_on_slices(model, steps, alongside=None):
    """Train ``model`` (DDP or FSDP2) on this rank's slice of each batch; ``alongside()``, if
    given, starts something before each step and returns a check to run after it."""
    r, n = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(n, steps):
        check = alongside() if alongside is not None else None
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[4 * r:4 * (r + 1)]), y[4 * r:4 * (r + 1)]).backward()
        opt.step()
        if check is not None:
            check()


def _assert_like_one_process(params, steps):
    for got, want in zip(params, _reference(dist.get_world_size(), steps)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_ddp_trains_like_one_process(backend):
    _need(backend)
    model = _model()
    with _pinned(backend):
        _train_on_slices(torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005),
                         3)
    _assert_like_one_process(model.parameters(), 3)


def test_ddp_on_mpi_mixed_with_the_programs_own_alltoall_on_gloo():
    """One step: DDP's allreduces (mpi) during backward, the program's own alltoall (gloo) on
    the same communicator in flight across it; both results checked."""
    _need("mpi", "gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    comm = mcrdl.torch.communicator()

    def alltoall():
        moved = comm.alltoall(torch.arange(3.0 * n) + 100 * r, backend="gloo")

        def check():
            assert moved.wait().tolist() == [100.0 * s + 3 * r + k for s in range(n)
                                             for k in range(3)]
        return check

    model = _model()
    with _pinned("mpi"):
        _train_on_slices(torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005),
                         2, alltoall)
    _assert_like_one_process(model.parameters(), 2)


def test_in_place_all_gather_single():
    """The input is this rank's slot of the output, as torch allows and FSDP2 does."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(2 * n)
    out[2 * r:2 * r + 2] = float(r + 1)
    dist.all_gather_single(out, out[2 * r:2 * r + 2])
    assert out.tolist() == [float(i + 1) for i in range(n) for _ in range(2)]


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_fsdp2_trains_like_one_process(backend):
    from torch.distributed.fsdp import fully_shard

    _need(backend)
    model = _model()
    with _pinned(backend):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        _train_on_slices(model, 3)
        full = [p.full_tensor() for p in model.parameters()]
    _assert_like_one_process(full, 3)


def test_receives_from_any_source():
    """``dist.recv`` without ``src`` returns the sender; ``irecv``'s Work names it (MPI).
    Without MPI (torchrun) it is refused, naming what it needs."""
    r, n = dist.get_rank(), dist.get_world_size()
    if "mpi" not in mcrdl.torch.communicator().backends:
        if r == 0:
            with pytest.raises(mcrdl.UnsupportedOperationError, match="from any source"):
                dist.recv(torch.empty(2), tag=4)
        return
    if r == 0:
        senders = []
        for _ in range(n - 1):
            t = torch.empty(2)
            sender = dist.recv(t, tag=4)
            assert t.tolist() == [float(sender)] * 2
            senders.append(sender)
        for _ in range(n - 1):
            t = torch.empty(2)
            work = dist.irecv(t, tag=5)
            work.wait()
            assert t.tolist() == [10.0 * work._source_rank()] * 2
            senders.append(work._source_rank())
        assert sorted(senders) == sorted(2 * list(range(1, n)))
    else:
        dist.send(torch.full((2,), float(r)), dst=0, tag=4)
        dist.send(torch.full((2,), 10.0 * r), dst=0, tag=5)


def test_bad_arguments_raise_at_the_call():
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=f"list of {n} tensors"):
        dist.all_gather([torch.empty(2)] * (n + 1), torch.ones(2))
    with pytest.raises(ValueError, match="BAND is bitwise and float32 is a floating-point"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="needs"):
        dist.all_gather_single(torch.empty(n * 2 + 1), torch.ones(2))
    dist.barrier()  # nothing was submitted: the ranks are still in step


def test_a_failed_operation_fails_its_work():
    """A receive into a buffer smaller than the message fails on its own (the peers matched
    it): wait() raises the backend's error, is_success() and exception() say so, and the
    future fails too."""
    _need("mpi")
    r = dist.get_rank()
    if r == 0:
        dist.send(torch.arange(4.0), dst=1, tag=9)
    elif r == 1:
        work = dist.irecv(torch.zeros(2), src=0, tag=9)
        fut = work.get_future()
        with pytest.raises(mcrdl.BackendError):
            work.wait()
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), mcrdl.BackendError)
        with pytest.raises(Exception, match="MPI"):
            fut.wait()
    dist.barrier()
