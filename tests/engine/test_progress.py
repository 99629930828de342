"""The progress engine (``engine._core``): issue order, hazards and ``after=`` edges across
backends, failures and cancellation, timeouts, what stays alive; driven by hand against a
manual backend, without threads or sleeps."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from mcrdl import (
    BackendError,
    CommBrokenError,
    CommTimeoutError,
    DependencyFailedError,
    FutureCancelledError,
    InvalidStateError,
    RuntimeFinalizedError,
)
from mcrdl.engine import CommFuture, Engine
from mcrdl.engine import _breaks as progress
from mcrdl.observe._flight import flight_record
from tests.engine.support import A_HALF, A, B, Counting, Holds, Uncancellable, finish, submit
from tests.manual_backend import ManualBackend


def test_issues_at_submit_when_lane_idle_and_no_dependencies(engine, mpi):
    f = submit(engine, mpi, "allreduce", writes=[A])
    assert f.state == "ISSUED"
    assert mpi.events == [("start", "allreduce")]
    finish(engine, mpi, 0)
    assert f.done() and f.result() is None

def test_independent_ops_on_one_lane_are_all_in_flight(engine, mpi):
    fs = [submit(engine, mpi, "allreduce", writes=[(0x1000 * i, 0x1000 * i + 8)])
          for i in range(1, 4)]
    assert [f.state for f in fs] == ["ISSUED"] * 3

def test_read_after_write_across_backends_waits_for_completion(engine, mpi, gloo):
    w = submit(engine, gloo, "allreduce", writes=[A])
    r = submit(engine, mpi, "alltoall", reads=[A], writes=[B])
    assert r.state == "PENDING" and mpi.started == []
    finish(engine, gloo, 0)
    assert w.state == "DONE" and r.state == "ISSUED"

def test_write_after_read_and_write_after_write(engine, mpi, gloo):
    r = submit(engine, mpi, "send", reads=[A])
    w = submit(engine, gloo, "recv", writes=[A])
    w2 = submit(engine, mpi, "broadcast", writes=[A])
    assert (r.state, w.state, w2.state) == ("ISSUED", "PENDING", "PENDING")
    finish(engine, mpi, 0)
    assert (w.state, w2.state) == ("ISSUED", "PENDING")
    finish(engine, gloo, 0)
    assert w2.state == "ISSUED"

def test_reads_do_not_order_reads(engine, mpi, gloo):
    submit(engine, mpi, "send", reads=[A])
    f = submit(engine, gloo, "send", reads=[A])
    assert f.state == "ISSUED"

def test_partial_overlap_is_a_hazard(engine, mpi, gloo):
    submit(engine, mpi, "recv", writes=[A])
    f = submit(engine, gloo, "send", reads=[A_HALF])
    g = submit(engine, gloo, "send", reads=[(A[1], A[1] + 8)])  # adjacent, not overlapping
    assert f.state == "PENDING"
    assert g.state == "PENDING"  # behind f on the gloo lane: no overtaking
    finish(engine, mpi, 0)
    assert f.state == g.state == "ISSUED"

def test_no_overtaking_in_a_lane(engine, mpi, gloo):
    submit(engine, gloo, "allreduce", writes=[A])
    blocked = submit(engine, mpi, "allreduce", writes=[A])
    ready = submit(engine, mpi, "allreduce", writes=[B])
    assert blocked.state == "PENDING" and ready.state == "PENDING"
    assert mpi.started == []
    finish(engine, gloo, 0)
    assert [r.args for r in mpi.started] == [("allreduce",), ("allreduce",)]
    assert blocked.state == ready.state == "ISSUED"

def test_lanes_of_different_communicators_are_independent(engine, mpi, gloo):
    submit(engine, gloo, "allreduce", writes=[A])
    submit(engine, mpi, "allreduce", writes=[A], comm="world")
    other = submit(engine, mpi, "allreduce", writes=[B], comm="world.1c0")
    assert other.state == "ISSUED"

def test_after_edges(engine, mpi, gloo):
    first = submit(engine, gloo, "barrier")
    second = submit(engine, mpi, "barrier", after=[first])
    assert second.state == "PENDING"
    finish(engine, gloo, 0)
    assert second.state == "ISSUED"

def test_after_a_failed_future_fails_at_once(engine, mpi):
    bad = submit(engine, mpi, "barrier")
    finish(engine, mpi, 0, RuntimeError("boom"))
    f = submit(engine, mpi, "barrier", after=[bad])
    assert f.state == "FAILED"
    with pytest.raises(DependencyFailedError, match=r"depends on barrier#\d+, which failed: boom"):
        f.result()
    assert len(mpi.started) == 1

def test_after_rejects_non_futures(engine, mpi):
    with pytest.raises(TypeError, match=r"^after= takes CommFutures, got int: 3$"):
        submit(engine, mpi, "barrier", after=[3])
    assert engine.stats().submitted == 0

def test_failure_propagates_to_exactly_the_dependants(engine, mpi, gloo):
    src = submit(engine, gloo, "allreduce", writes=[A])
    dep = submit(engine, mpi, "send", reads=[A])
    dep2 = submit(engine, mpi, "broadcast", writes=[B], after=[dep])
    independent = submit(engine, gloo, "allreduce", writes=[(0x9000, 0x9008)])
    lane_successor = submit(engine, gloo, "barrier")
    finish(engine, gloo, 0, RuntimeError("gloo exploded"))
    assert src.state == "FAILED"
    assert isinstance(src.exception(), RuntimeError)
    assert dep.state == "FAILED" and isinstance(dep.exception(), DependencyFailedError)
    assert dep2.state == "FAILED" and isinstance(dep2.exception(), DependencyFailedError)
    assert independent.state == "ISSUED"
    assert lane_successor.state == "ISSUED"
    assert mpi.started == []

def test_backend_start_error_fails_only_that_future(engine, mpi):
    mpi.fail_start = "invalid communicator"
    bad = submit(engine, mpi, "allreduce", writes=[A])
    mpi.fail_start = None
    good = submit(engine, mpi, "allreduce", writes=[B])
    assert bad.state == "FAILED"
    with pytest.raises(BackendError, match=r"failed to start: invalid communicator$"):
        bad.result()
    assert good.state == "ISSUED"

def test_cancel_pending_fails_dependants(engine, mpi, gloo):
    submit(engine, gloo, "allreduce", writes=[A])
    victim = submit(engine, mpi, "allreduce", writes=[A])
    dependant = submit(engine, mpi, "send", reads=[A])
    assert victim.cancel() is True
    assert victim.cancelled() and victim.state == "CANCELLED"
    with pytest.raises(FutureCancelledError):
        victim.result()
    assert isinstance(dependant.exception(), DependencyFailedError)
    assert "cancelled" in str(dependant.exception())

def test_cancel_issued_is_refused_when_backend_cannot(engine, mpi):
    mpi.capabilities = type(mpi.capabilities)(
        ops=mpi.capabilities.ops, dtypes=mpi.capabilities.dtypes, cancel=False)
    f = submit(engine, mpi, "barrier")
    with pytest.raises(InvalidStateError, match=r"cannot cancel .* it was issued already"):
        f.cancel()
    finish(engine, mpi, 0)
    assert f.cancel() is False

def test_cancelled_writer_does_not_hide_an_earlier_writer(engine, mpi, gloo):
    # w1 in flight, w2 waits for it and is cancelled: a later reader must still wait for w1.
    w1 = submit(engine, gloo, "allreduce", writes=[A])
    w2 = submit(engine, mpi, "allreduce", writes=[A])
    w2.cancel()
    reader = submit(engine, mpi, "send", reads=[A], comm="other")
    assert reader.state == "PENDING"
    finish(engine, gloo, 0)
    assert w1.state == "DONE" and reader.state == "ISSUED"

def test_long_chain_settles_without_recursion(engine, mpi):
    class Sync(ManualBackend):
        def _start(self, op, *args):
            return None  # finished during start

    sync = Sync(name="sync")
    head = submit(engine, mpi, "allreduce", writes=[A])
    chain = [submit(engine, sync, "allreduce", writes=[A]) for _ in range(5000)]
    assert chain[-1].state == "PENDING"
    finish(engine, mpi, 0)
    assert head.state == "DONE" and all(f.state == "DONE" for f in chain)
    assert engine.stats().in_flight == 0 and engine.in_flight() == 0

@pytest.mark.parametrize("verdict", ["timeout", "desync"])
def test_a_fingerprint_check_is_its_collectives_own_verdict(clock, mpi, verdict):
    """Debug mode's check of a collective's fingerprint speaks for the collective: when the
    peers do not arrive in time, the collective fails with CommTimeoutError, and with
    DesyncError when the fingerprints differ -- each naming the collective, never a failed
    dependency (which would hide why)."""
    from mcrdl import DesyncError
    from mcrdl.engine._states import CHECK_KIND

    engine = Engine(background=False, clock=clock, timeout=5.0)
    group = mpi.world()
    lane = engine.lane(mpi, group, engine.comm("world", group.rank, group.size))

    def finish_check(_fut):
        raise DesyncError("rank 0: allreduce#1 ...; rank 1: broadcast#1 ...")

    check = engine.submit(CommFuture(CHECK_KIND, lane, 1, mpi.start_allgather, ("check",), (),
                                     (), None, 0, finish_check if verdict == "desync" else None))
    op = submit(engine, mpi, "allreduce", writes=[A], after=[check])
    if verdict == "timeout":
        clock.now += 6.0
        engine.check_deadlines(clock.now)
    else:
        finish(engine, mpi, 0)
    error = op.exception()
    expected = CommTimeoutError if verdict == "timeout" else DesyncError
    assert type(error) is expected and str(error).startswith(f"allreduce#{op.seq}: ")


def test_timeout_fails_old_ops_and_dumps_flight_record(clock, mpi):
    dumps = []
    engine = Engine(background=False, clock=clock, timeout=5.0,
                    on_timeout=lambda expired: dumps.append((expired, flight_record(engine))))
    done = submit(engine, mpi, "barrier")
    finish(engine, mpi, 0)
    old = submit(engine, mpi, "allreduce", writes=[A])
    clock.now += 3
    young = submit(engine, mpi, "allreduce", writes=[B])
    engine.check_deadlines(clock.now)
    assert old.state == young.state == "ISSUED"
    clock.now += 2.5
    engine.check_deadlines(clock.now)
    assert old.state == "FAILED" and young.state == "ISSUED" and done.state == "DONE"
    err = old.exception()
    assert isinstance(err, CommTimeoutError) and isinstance(err, TimeoutError)
    assert f"allreduce#{old.seq} on lane mpi:world (rank 0 of 1) did not finish within 5 s" in str(err)
    [(expired, record)] = dumps
    assert expired == [old]
    assert "lane mpi:world rank 0/1" in record
    assert f"barrier#{done.seq}" in record and "DONE" in record
    assert f"allreduce#{young.seq}" in record and "ISSUED" in record

@pytest.mark.parametrize("behind", ["hazard", "after"])
def test_timeout_counts_from_issue_not_from_submission(clock, mpi, gloo, behind):
    """An operation that waited 4 s behind another (its buffer's writer, or an ``after=``
    dependency) has the whole timeout once it is issued: 5 s from its issue, not 1 s."""
    engine = Engine(background=False, clock=clock, timeout=5.0)
    t0 = clock.now
    first = submit(engine, gloo, "allreduce", writes=[A])
    if behind == "hazard":
        queued = submit(engine, mpi, "allreduce", writes=[A])
    else:
        queued = submit(engine, mpi, "allreduce", writes=[B], after=[first])
    assert queued.state == "PENDING"
    clock.now = t0 + 4.0
    engine.check_deadlines(clock.now)
    assert first.state == "ISSUED" and queued.state == "PENDING"
    finish(engine, gloo, 0)
    assert first.state == "DONE" and queued.state == "ISSUED" and queued.t_issue == t0 + 4.0
    for at in (6.0, 8.0, 8.9):  # 2, 4 and 4.9 s after its issue (6 to 8.9 after submission)
        clock.now = t0 + at
        engine.check_deadlines(clock.now)
        assert queued.state == "ISSUED", f"timed out {at - 4.0:g} s after its issue"
    clock.now = t0 + 9.2  # 5.2 s after its issue (and past the next check, 0.25 s after 8.9)
    engine.check_deadlines(clock.now)
    assert queued.state == "FAILED"
    with pytest.raises(CommTimeoutError, match=(
            rf"^allreduce#{queued.seq} on lane mpi:world \(rank 0 of 1\) did not finish within "
            r"5 s of being issued; the peers it needs have not all arrived$")):
        queued.result()

def test_fail_all_and_close(engine, mpi):
    f = submit(engine, mpi, "barrier")
    g = submit(engine, mpi, "barrier", after=[f])
    n = engine.fail_all(lambda fut: RuntimeFinalizedError(f"finalized before {fut.kind}"))
    assert n == 2
    assert isinstance(f.exception(), RuntimeFinalizedError)
    assert isinstance(g.exception(), (RuntimeFinalizedError, DependencyFailedError))
    engine.close("test")
    with pytest.raises(RuntimeFinalizedError, match=r"^cannot submit barrier: the runtime was finalized \(test\)$"):
        submit(engine, mpi, "barrier")

def test_stats_and_repr(engine, mpi, gloo):
    f = submit(engine, gloo, "allreduce", writes=[A])
    g = submit(engine, mpi, "allreduce", writes=[A])
    assert repr(g) == f"<CommFuture allreduce#{g.seq} PENDING on mpi lane=world rank=0/1 deps=1>"
    s = engine.stats()
    assert (s.submitted, s.issued, s.pending, s.in_flight, s.lanes) == (2, 1, 1, 1, 2)
    finish(engine, gloo, 0)
    finish(engine, mpi, 0)
    s = engine.stats()
    assert (s.completed, s.pending, s.in_flight) == (2, 0, 0)
    assert f.done()

def test_an_operation_holds_its_buffers_until_it_ends_however_it_ends(engine, mpi, gloo):
    """``hold`` stays alive while the operation is unfinished and is let go when it finishes,
    fails, is cancelled or fails with a dependency; ``start`` and ``args`` are let go once it
    is issued, or once it ends unissued (an operation in flight keeps two objects fewer for
    the garbage collector)."""
    held = Holds()
    a = submit(engine, mpi, "allreduce", writes=[A], hold=held("a"))  # issued at once
    b = submit(engine, mpi, "allreduce", writes=[A], hold=held("b"))  # waits for a
    c = submit(engine, gloo, "allreduce", writes=[B], hold=held("c"))
    d = submit(engine, gloo, "allreduce", writes=[B], hold=held("d"))  # waits for c
    e = submit(engine, gloo, "allreduce", after=[b], hold=held("e"))  # fails with b
    assert (a.start, a.args) == (None, None) and b.args == ("allreduce",)
    assert held.alive() == ["a", "b", "c", "d", "e"]
    finish(engine, mpi, 0)
    assert a.state == "DONE" and b.state == "ISSUED" and b.args is None
    assert held.alive() == ["b", "c", "d", "e"]
    assert d.cancel()
    assert held.alive() == ["b", "c", "e"] and (d.start, d.args) == (None, None)
    finish(engine, mpi, 1, error=RuntimeError("link down"))
    assert b.state == "FAILED" and e.state == "FAILED" and (e.start, e.args) == (None, None)
    assert held.alive() == ["c"]
    finish(engine, gloo, 0)
    assert c.state == "DONE" and held.alive() == []

    # The lone wait settles through the same path: it lets go too.
    lone = Engine(background=False)
    fut = submit(lone, Counting(after=3), "allreduce", hold=held("lone"))
    assert held.alive() == ["lone"]
    fut.wait(timeout=5.0)
    assert held.alive() == []

def test_an_issued_operation_that_fails_keeps_its_buffers_if_its_backend_may_still_use_them(
        clock, gloo):
    """A timed-out or aborted operation whose backend cannot cancel it may still have its
    memory read or written by that backend: its buffers (and its result) stay alive. One
    that its backend cancelled, or that was never issued, lets go."""
    mpi = Uncancellable(name="mpi")
    engine = Engine(background=False, clock=clock, timeout=10.0)
    held = Holds()
    a = submit(engine, mpi, "allreduce", writes=[A], hold=held("a"))
    b = submit(engine, gloo, "allreduce", hold=held("b"))  # its backend cancels it
    clock.now += 11
    engine.check_deadlines(clock.now)
    assert isinstance(a.exception(), CommTimeoutError)
    assert isinstance(b.exception(), CommTimeoutError)
    assert held.alive() == ["a"]
    c = submit(engine, mpi, "allreduce", writes=[B], hold=held("c"))
    d = submit(engine, mpi, "allreduce", writes=[B], hold=held("d"))  # waits for c
    assert engine.fail_all(lambda f: RuntimeFinalizedError("finalized")) == 2
    assert c.state == d.state == "FAILED"
    assert held.alive() == ["a", "c"]


# -- rule 7: an operation that will not run as issued breaks its communicator ------------


def _pair(name="mpi", **kw):
    """A backend whose world has two ranks (this one is rank 0): operations have a peer."""
    return ManualBackend(name=name, rank=0, size=2, **kw)


def test_an_operation_that_ends_unissued_breaks_its_communicator(engine):
    """Nothing more is issued on it: what was pending fails, and so does everything later;
    this rank tells its peers where it stopped on each lane. What it had issued runs on:
    it finishes wherever every member issued it."""
    mpi, gloo = _pair("mpi"), _pair("gloo")
    told = []
    engine.on_break = lambda comm, cause, stops: told.append((comm.name, cause, stops))
    a = submit(engine, mpi, "allreduce", writes=[A])  # issued: index 1 of mpi:world
    b = submit(engine, mpi, "allreduce", writes=[A])  # waits for a: index 2
    behind = submit(engine, mpi, "allreduce", writes=[B])  # behind b in the lane: index 3
    c = submit(engine, gloo, "allreduce", writes=[(0x7000, 0x7008)])  # issued: gloo:world #1
    d = submit(engine, gloo, "allreduce", writes=[(0x9000, 0x9008)], comm="other")
    assert b.cancel() is True and b.cancelled()
    cause = f"on rank 0, allreduce#{b.seq} on lane mpi:world was cancelled"
    assert told == [("world", cause, {"mpi:world": (2, {}), "gloo:world": (2, {})})]
    assert isinstance(behind.exception(), CommBrokenError)
    assert f"communicator world is broken ({cause}); nothing more runs on it" in str(
        behind.exception())
    assert a.state == c.state == d.state == "ISSUED"
    started = len(mpi.started)
    later = submit(engine, mpi, "barrier")
    assert isinstance(later.exception(), CommBrokenError) and len(mpi.started) == started
    assert len(told) == 1  # told once
    finish(engine, mpi, 0)
    assert a.state == "DONE"


def test_what_a_member_that_stopped_will_never_match_fails_and_nothing_else(engine):
    """Told of a peer's stops, an operation at or past its stop on the lane fails; one
    before it runs on. Sends and receives are matched per peer, tag and direction."""
    mpi = _pair()
    group = mpi.world()
    lane = engine.lane(mpi, group, engine.comm("world", group.rank, group.size))
    one = submit(engine, mpi, "allreduce", writes=[A])  # collective index 1
    two = submit(engine, mpi, "allreduce", writes=[B])  # collective index 2

    def p2p(kind, tag):
        fut = CommFuture(kind, lane, 0, getattr(mpi, f"start_{kind}"), (kind,), (), (), None,
                         0, stream=(1, tag, kind == "send"))
        return engine.submit(fut)

    sent, received = p2p("send", 7), p2p("recv", 7)  # index 1 of each stream
    engine.post_break("world", "on rank 1, x#9 was cancelled", 1,
                      {"mpi:world": (2, {(0, 7, False): 2})})  # received 1 send of ours
    engine.check_signals()
    assert one.state == "ISSUED" and sent.state == "ISSUED"
    for fut in (two, received):  # rank 1 never issues its 2nd collective nor sends to us
        assert "(on rank 1, x#9 was cancelled)" in str(fut.exception())
    assert engine._comms["world"].stops[0] == {"mpi:world": (3, {(1, 7, True): 2,
                                                                 (1, 7, False): 2})}


def test_a_failure_its_backend_reports_is_the_operations_own(engine):
    """The peers matched an issued operation that then failed here (a truncated receive):
    the communicator stays in step, until an operation that depends on it cannot be issued."""
    mpi = _pair()
    bad = submit(engine, mpi, "recv", writes=[A])
    other = submit(engine, mpi, "allreduce", writes=[B])
    finish(engine, mpi, 0, BackendError("MPI: message truncated"))
    assert bad.state == "FAILED" and other.state == "ISSUED"
    assert engine._comms["world"].broken is None
    dep = submit(engine, mpi, "send", reads=[A], after=[bad])  # cannot be issued
    assert isinstance(dep.exception(), DependencyFailedError)
    assert "recv" in engine._comms["world"].broken
    assert isinstance(submit(engine, mpi, "barrier").exception(), CommBrokenError)
    assert other.state == "ISSUED"  # issued before the break: it runs on


def test_a_timeout_breaks_its_communicator(clock):
    mpi = _pair()
    told = []
    engine = Engine(background=False, clock=clock, timeout=5.0)
    engine.on_break = lambda comm, cause, stops: told.append(cause)
    old = submit(engine, mpi, "allreduce", writes=[A])
    clock.now += 6
    engine.check_deadlines(clock.now)
    assert isinstance(old.exception(), CommTimeoutError)
    assert len(told) == 1 and "did not finish within 5 s" in told[0]
    later = submit(engine, mpi, "allreduce", writes=[B])
    assert "did not finish within 5 s" in str(later.exception())


def test_a_break_a_peer_tells_of_is_applied_at_the_next_check(engine):
    mpi = _pair()
    a = submit(engine, mpi, "allreduce", writes=[A])
    b = submit(engine, mpi, "allreduce", writes=[A])
    engine.post_break("world", "on rank 1, allreduce#2 on lane mpi:world was cancelled", 1,
                      {"mpi:world": (1, {})})
    engine.post_break("world.1c0", "on rank 1, barrier#1 on lane mpi:world.1c0 was cancelled",
                      1, {})
    assert a.state == "ISSUED" and b.state == "PENDING"  # applied at the next check only
    engine.check_signals()
    for fut in (a, b):
        assert "communicator world is broken (on rank 1, allreduce#2" in str(fut.exception())
    # Told of before this rank made it (a peer may break one while it is still being made).
    early = submit(engine, mpi, "barrier", comm="world.1c0")
    assert "(on rank 1, barrier#1 on lane mpi:world.1c0 was cancelled)" in str(
        early.exception())


def test_a_process_told_gone_breaks_its_communicators_made_before_and_after(engine):
    """The launcher says world rank 1 is gone: what is in flight on a communicator with it
    fails with PeerLostError at the next check, so does a communicator with it made later
    (a shrink's attempt that agreed on it just before it died), and one without it goes
    on."""
    from mcrdl import PeerLostError

    mpi = _pair()
    engine.comm("world", 0, 2, (0, 1))
    engine.comm("alone", 0, 1, (0,))
    a = submit(engine, mpi, "allreduce", writes=[A])
    engine.post_lost(1, "its process was ended by SIGKILL")
    assert a.state == "ISSUED"  # applied at the next check only
    engine.check_signals()
    assert isinstance(a.exception(), PeerLostError)
    assert "rank 1 is gone: its process was ended by SIGKILL" in str(a.exception())
    engine.comm("later", 0, 2, (0, 1))
    later = submit(engine, mpi, "barrier", comm="later")
    assert isinstance(later.exception(), PeerLostError)
    assert submit(engine, mpi, "barrier", comm="alone").state == "ISSUED"
    assert engine.gone == {1: "its process was ended by SIGKILL"}


def test_a_communicator_of_one_never_breaks(engine, mpi):
    submit(engine, mpi, "allreduce", writes=[A])
    victim = submit(engine, mpi, "allreduce", writes=[A])
    victim.cancel()
    assert submit(engine, mpi, "allreduce", writes=[B]).state == "ISSUED"
    assert engine._comms["world"].broken is None


def test_a_zombie_keeps_its_bytes_until_its_backend_is_done_with_them(clock):
    """An issued operation the engine gives up on, which its backend cannot cancel, may
    still write its buffer: an operation on those bytes fails at once instead of racing it,
    until the backend reports the zombie finished."""
    mpi = _pair()
    mpi.cancel = lambda request: False  # like MPI's collectives
    engine = Engine(background=False, clock=clock)
    zombie = submit(engine, mpi, "allreduce", writes=[A])
    engine.post_break("world", "on rank 1, x#1 was cancelled", 1, {})  # it never issued it
    engine.check_signals()
    assert isinstance(zombie.exception(), CommBrokenError)
    assert engine.stats().zombies == 1 and engine.zombies() == [zombie]
    racer = submit(engine, mpi, "allreduce", reads=[A_HALF], comm="other")
    assert isinstance(racer.exception(), DependencyFailedError)  # (and "other" breaks)
    assert "may still write: it was given up while issued" in str(racer.exception())
    assert submit(engine, mpi, "allreduce", writes=[B], comm="second").state == "ISSUED"
    mpi.started[0].done = True  # the backend lets go: the next touch buries it
    assert submit(engine, mpi, "allreduce", writes=[A], comm="second").state == "ISSUED"
    assert engine.stats().zombies == 0
    # Or the periodic check buries it.
    third = submit(engine, mpi, "allreduce", writes=[(0x5000, 0x5008)], comm="third")
    engine.post_break("third", "on rank 1, x#1 was cancelled", 1, {})
    engine.check_signals()
    assert engine.stats().zombies == 1
    third._request.done = True
    clock.now += 1
    engine.check_deadlines(clock.now)
    assert engine.stats().zombies == 0


# -- routed operations -------------------------------------------------------------------


def _routed(engine, lanes, choose, after=(), writes=()):
    fut = CommFuture("alltoallv", lanes[0], 99, None, (None,), (), tuple(writes), "r", 0)
    return engine.submit(fut, after, (tuple(lanes), choose))


def test_a_routed_operation_holds_its_place_in_every_candidate_lane(engine):
    mpi, gloo = _pair("mpi"), _pair("gloo")
    comm = engine.comm("world", 0, 2)
    lanes = [engine.lane(mpi, mpi.world(), comm), engine.lane(gloo, gloo.world(), comm)]
    exchange = submit(engine, mpi, "alltoall")

    def choose(fut):
        fut.lane, fut.start, fut.args = lanes[1], gloo.start_alltoallv, ("routed",)

    routed = _routed(engine, lanes, choose, after=[exchange])
    on_mpi = submit(engine, mpi, "allreduce", writes=[A])
    on_gloo = submit(engine, gloo, "allreduce", writes=[B])
    assert (routed.state, on_mpi.state, on_gloo.state) == ("PENDING",) * 3
    finish(engine, mpi, 0)  # the exchange: routed goes to gloo, then what waited behind it
    assert [r.args for r in gloo.started] == [("routed",), ("allreduce",)]
    assert [r.args for r in mpi.started] == [("alltoall",), ("allreduce",)]
    assert routed.lane is lanes[1] and routed.state == on_mpi.state == "ISSUED"


def test_a_routed_operation_that_cannot_be_routed_fails_and_lets_the_lanes_go(engine):
    mpi = _pair()
    comm = engine.comm("world", 0, 2)
    lane = engine.lane(mpi, mpi.world(), comm)

    def choose(fut):
        raise ValueError("no backend for 3 GiB")

    gate = submit(engine, mpi, "alltoall")
    routed = _routed(engine, [lane], choose, after=[gate])
    finish(engine, mpi, 0)
    assert routed.state == "FAILED" and "no backend for 3 GiB" in str(routed.exception())
    assert "no backend for 3 GiB" in comm.broken  # it was never issued: its peers may have


# -- observers ---------------------------------------------------------------------------


def test_observers_see_every_submission_with_its_descriptor_before_it_is_issued(engine, mpi):
    seen = []
    stop = engine.observe(lambda fut, after: seen.append((fut.kind, fut.state, fut.args,
                                                          after)))
    first = submit(engine, mpi, "allreduce", writes=[A])
    submit(engine, mpi, "broadcast", writes=[B], after=[first])
    stop()
    submit(engine, mpi, "barrier")
    assert seen == [("allreduce", "PENDING", ("allreduce",), ()),
                    ("broadcast", "PENDING", ("broadcast",), (first,))]


# -- exit: threads held in a backend -------------------------------------------------------


class _HoldsThreads(Uncancellable):
    """Like gloo's sends and receives: each request holds a thread until it ends."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.capabilities = dataclasses.replace(self.capabilities, waits_in_threads=True)
        self.held = {}

    def thread_held(self, request):
        return self.held.setdefault(id(request), threading.Event())


def test_exit_waits_for_held_threads_but_not_for_a_lower_peer_that_waits_in_turn(monkeypatch):
    """Rank 1 of 3 abandons a receive from rank 0 and one from rank 2, each holding a thread.
    Rank 0 told it has a receive from rank 1 that rank 1 never sent: it waits for rank 1 to
    end, so rank 1 waits only for the thread on rank 2's receive (else both would wait until
    the timeout); ``before`` runs once, since something is waited for."""
    monkeypatch.setattr(progress, "_ABANDONED", [])
    monkeypatch.setattr(progress, "_WAITED_BY", set())
    backend = _HoldsThreads(rank=1, size=3)
    engine = Engine(background=False, timeout=5.0)
    group = backend.world()
    lane = engine.lane(backend, group, engine.comm("world", 1, 3, (0, 1, 2)))

    def recv(peer):
        fut = CommFuture("recv", lane, 0, backend.start_recv, ("recv",), (), (), None, 0,
                         stream=(peer, 0, False))
        return engine.submit(fut)

    from_0, from_2 = recv(0), recv(2)
    engine.post_break("world", "on rank 0, x#1 was cancelled", 0,
                      {lane.key: (1, {(1, 0, False): 2})})  # it sent nothing, awaits one
    engine.post_break("world", "on rank 0, x#1 was cancelled", 2, {lane.key: (1, {})})
    engine.check_signals()
    assert isinstance(from_0.exception(), CommBrokenError)
    assert isinstance(from_2.exception(), CommBrokenError)
    engine.close("test")
    assert progress._WAITED_BY == {0}
    befores = []
    threading.Timer(0.2, backend.thread_held(backend.started[1]).set).start()
    start = time.monotonic()
    progress.linger(before=lambda: befores.append(1))
    took = time.monotonic() - start
    assert 0.15 < took < 2.0, took  # the thread on rank 2's receive, not rank 0's
    assert befores == [1]
    assert not backend.thread_held(backend.started[0]).is_set()


def test_a_stream_ordered_backend_without_a_stream_is_refused_at_its_lane(engine):
    """A host backend has no stream (Backend.stream's default); one that says it is
    stream_ordered and gives none would have its lanes ordered as host lanes."""
    host = ManualBackend(name="mpi")
    assert host.stream(host.world()) is None
    broken = ManualBackend(name="nccl", capabilities=dataclasses.replace(
        ManualBackend.capabilities, stream_ordered=True, in_order=True))
    group = broken.world()
    with pytest.raises(TypeError, match=r"'nccl' says its operations are stream_ordered but "
                                        r"gives no stream"):
        engine.lane(broken, group, engine.comm("world", group.rank, group.size))
