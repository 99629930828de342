"""Named collectives (docs/design.md rule 8), simulated: ranks submit them in different orders, as
concurrent asyncio tasks do, and every result equals the sequential reference; a policy that
issues them in each rank's own submission order is caught and shrunk.

Also the agreement's own promises: the response cache (a step of known names costs a bounded
number of rounds, whatever their number), a name reused before it finished, a name submitted
with another signature elsewhere, and a name some member never submits.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from mcrdl import CommBrokenError, DesyncError, ReduceOp
from mcrdl.core._buffers import Buffer
from mcrdl.observe._flight import flight_record
from mcrdl.testing import FAULTS, SimMismatch, SimWorld, check_program, programs

from . import examples
from .broken import NamesIgnoredEngine

MPI_LIKE = {"mpi": "windowed", "gloo": "mpi"}
SEMANTICS = {"mpi": "windowed", "gloo": "mpi", "nccl": "nccl", "blk": "blocking"}


def _counting_fusions(real, figures):
    def init(self, *args):
        figures["fused groups"] += 1
        real(self, *args)

    return init


def _counting_faults(real, figures):
    from mcrdl.engine import _fusion

    def fault(world, args):
        kind = real(world, args)
        if kind is not None and any(type(a) is Buffer and _fusion.carried(a.obj) for a in args):
            figures["faults fired on fused groups"] += 1
        return kind

    return fault


#: The properties' worlds: backends (name -> semantics), what else the programs draw (faults,
#: the kinds and reduce ops of their steps), and the response cache's size (None: as built).
FUSING = {"kinds": ("allreduce",) * 4 + ("broadcast", "alltoall"), "dtypes": ("float64",),
          "ops": (ReduceOp.SUM, ReduceOp.AVG), "auto": False, "slot_length": 96,
          "max_splits": 1}
CASES = {
    "mpi-like": (MPI_LIKE, {}, None),
    "every semantics": (SEMANTICS, {}, None),
    "faults": (MPI_LIKE, {"min_faults": 1, "max_faults": 2, "faults": FAULTS}, None),
    # two slots: names evicted and published again in most rounds
    "small cache": (MPI_LIKE, {}, 2),
    # mostly allreduces of one dtype on one backend, in longer slots (fewer overlaps, so
    # longer blocks): blocks whose members are fused (engine._fusion), with the faults that
    # can reach a fused operation (the others hold theirs back from the agreement, which
    # fuses only what is ready)
    "fusion": ({"mpi": "windowed"}, {**FUSING, "max_faults": 3, "faults": ("start", "error")},
               None),
}


#: Each case's strategy, made once: making one parses the generator's source (hypothesis's
#: ``composite``), which cost more than running some of the programs.
STRATEGIES = {case: programs(backends=tuple(backends), named=True, **faults)
              for case, (backends, faults, _) in CASES.items()}


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=examples(100), deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.data(), st.integers(0, 2**16))
def test_named_blocks_in_per_rank_orders_match_the_reference(case, monkeypatch, data, seed):
    """Every rank's result equals the sequential reference; with faults, every element a
    correct runtime must have right, and nothing hangs."""
    from mcrdl.engine import _names

    backends, faults, slots = CASES[case]
    if slots is not None:
        monkeypatch.setattr(_names, "CACHE_SLOTS", slots)
    check_program(data.draw(STRATEGIES[case]), seed=seed, backends=backends)


def test_the_harness_permuted_named_blocks(monkeypatch):
    """The figures the closing note quotes, over a sample of the programs the "fusion" case
    above draws (derandomized: the same 100 in every run, whatever ran before; drawn at
    random, the fused groups over 500 programs ranged from 10 to 125 between runs): ranks
    submitted many blocks in different orders, and the engine fused many groups."""
    from mcrdl.engine import _fusion

    figures = {"programs": 0, "named operations": 0, "blocks": 0,
               "blocks submitted in different orders": 0, "fused groups": 0,
               "faults fired on fused groups": 0}
    monkeypatch.setattr(_fusion._Fused, "__init__",
                        _counting_fusions(_fusion._Fused.__init__, figures))
    monkeypatch.setattr(SimWorld, "fault", _counting_faults(SimWorld.fault, figures))
    backends, faults, _ = CASES["fusion"]

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(programs(backends=tuple(backends), named=True, **faults), st.integers(0, 2**16))
    def sample(program, seed):
        check_program(program, seed=seed, backends=backends)
        figures["programs"] += 1
        figures["named operations"] += len(program.named)
        figures["blocks"] += len(program.blocks)
        figures["blocks submitted in different orders"] += sum(
            len({orders[b] for orders in program.orders}) > 1
            for b in range(len(program.blocks)))

    sample()
    print(f"named harness: {figures}")
    assert figures["programs"] == 100
    assert figures["blocks submitted in different orders"] > figures["programs"] // 4
    assert figures["fused groups"] > figures["programs"] // 20


def test_issuing_named_operations_in_submission_order_is_caught():
    """Without the agreement, ranks that submit a block in different orders pair different
    operations: the harness finds a program where that gives wrong data or a mismatch, and
    shrinks it."""
    def broken(program):
        if not any(len({o[b] for o in program.orders}) > 1 for b in range(len(program.blocks))):
            return False
        for seed in range(3):
            try:
                check_program(program, seed=seed, backends=MPI_LIKE,
                              engine_factory=NamesIgnoredEngine)
            except (AssertionError, SimMismatch) as exc:
                broken.example = str(exc).splitlines()[0]
                return True
        return False

    found = find(programs(backends=tuple(MPI_LIKE), named=True), broken,
                 settings=settings(max_examples=600, deadline=None, database=None,
                                   derandomize=True, suppress_health_check=list(HealthCheck)))
    print(f"shrunk: {len(found.steps)} steps, blocks {found.blocks}, orders {found.orders}: "
          f"{broken.example}")
    assert found.blocks


# -- the agreement itself ----------------------------------------------------------------

def _run(size, program, **world):
    return SimWorld(size, MPI_LIKE, seed=world.pop("seed", 1), **world).run(program)


def test_tasks_in_opposite_orders_get_their_own_sums():
    """The issue's example: 1s and 100s allreduced in opposite orders on two ranks."""
    def program(comm):
        a, b = np.ones(4), np.full(4, 100.0)
        order = [("a", a), ("b", b)] if comm.rank == 0 else [("b", b), ("a", a)]
        futs = [comm.allreduce(t, name=n) for n, t in order]
        for f in futs:
            f.wait()
        return a[0], b[0]

    assert _run(2, program) == [(2.0, 200.0)] * 2


def test_a_step_of_cached_names_costs_a_bounded_number_of_rounds():
    """After the first step, 64 names submitted in per-rank orders agree in at most two
    rounds per step (the first name alone when it is ready before the rest, then the others
    as bits), not one per operation."""
    steps, n = 6, 64

    def program(comm):
        rng = np.random.default_rng(comm.rank)
        bufs = [np.full(2, float(i)) for i in range(n)]
        rounds = []
        for _ in range(steps):
            before = comm._names.rounds
            futs = [comm.allreduce(bufs[i], name=f"g{i}") for i in rng.permutation(n)]
            for f in futs:
                f.wait()
            rounds.append(comm._names.rounds - before)
        return rounds, [b[0] for b in bufs]

    out = _run(4, program)
    for rounds, values in out:
        assert max(rounds[1:]) <= 2, rounds
        assert values == [i * 4.0 ** steps for i in range(n)]


def test_a_name_in_use_cannot_be_submitted_again():
    def program(comm):
        a, b = np.ones(4), np.ones(4)
        first = comm.allreduce(a, name="g")
        with pytest.raises(ValueError, match="name 'g' is in use"):
            comm.allreduce(b, name="g")
        first.wait()
        comm.allreduce(b, name="g").wait()  # free again once it finished
        return a[0], b[0]

    assert _run(2, program) == [(2.0, 2.0)] * 2


@pytest.mark.parametrize("cached", [False, True])
def test_a_name_with_another_signature_elsewhere_fails_on_every_member(cached):
    """Every member that sees the other signature fails it with DesyncError; one that hears
    of the break from a peer first fails it with CommBrokenError naming that cause."""
    def program(comm):
        if cached:
            comm.allreduce(np.ones(4), name="g").wait()
        t = np.ones(4 if comm.rank == 0 else 8)
        with pytest.raises((DesyncError, CommBrokenError)) as info:
            comm.allreduce(t, name="g").wait()
        with pytest.raises(CommBrokenError):
            comm.allreduce(np.ones(2)).wait()
        return str(info.value)

    for text in _run(2, program):
        assert "float64[4]" in text and "float64[8]" in text, text


def test_a_name_some_member_never_submits_fails_naming_it():
    """Rank 2 never submits "b" and submits "c", which nobody else does: each fails, within
    the timeout, with DesyncError naming the members that lack it (or, where a peer's
    timeout came first, CommBrokenError naming that one); the flight recorder the timeout
    dumps lists the named operations waiting for agreement."""
    def program(comm):
        a, b = np.ones(2), np.ones(2)
        fa = comm.allreduce(a, name="a")
        late = comm.allreduce(b, name="b" if comm.rank != 2 else "c")
        fa.wait()
        with pytest.raises((DesyncError, CommBrokenError)) as info:
            late.wait()
        return type(info.value).__name__, str(info.value)

    world = SimWorld(3, MPI_LIKE, seed=1, timeout=2.0)
    records = []
    for runtime in world.runtimes:
        runtime.engine._on_timeout = (
            lambda expired, e=runtime.engine: records.append(flight_record(e)))
    out = world.run(program)
    assert "DesyncError" in {kind for kind, _ in out}
    for _, text in out:
        assert ("'b'" in text and "rank 2 had not submitted it" in text
                or "'c'" in text and "ranks 0, 1 had not submitted it" in text), text
    assert records and all("named operations of world" in r and "waiting for agreement" in r
                           for r in records), records


@pytest.mark.parametrize("size", [1, 2])
def test_names_used_once_are_forgotten(size):
    """A program that names its operations per step (``f"step{s}/grad{i}"``) must not keep
    every operation it ever named, nor grow the agreement's rows without bound: a finished
    operation is forgotten at the next round, and the response cache holds at most
    ``CACHE_SLOTS`` keys (the least recently agreed give theirs up). (That the buffers go
    with them is checked on MPI: tests/multirank/test_named.py; the simulated world keeps
    every operation for its own checks.)"""
    from mcrdl.engine import _names

    steps, n = 100, 4

    def program(comm):
        most = 0
        for s in range(steps):
            bufs = [np.full(2, float(i)) for i in range(n)]
            futs = [comm.allreduce(b, name=f"step{s}/grad{i}") for i, b in enumerate(bufs)]
            for f in futs:
                f.wait()
            assert [b[0] for b in bufs] == [size * i for i in range(n)]
            most = max(most, len(comm._names.live))
        return most, len(comm._names.keys)

    for most, keys in _run(size, program):
        # a round forgets what finished before it; with no rounds (a world of one),
        # submissions do, each time the names have doubled since the last time
        assert most <= (n if size > 1 else 2 * (64 + n)), most
        assert keys == (0 if size == 1 else min(steps * n, _names.CACHE_SLOTS))


@pytest.mark.parametrize("slots", [1, 3])
def test_a_full_response_cache_gives_slots_to_new_names_and_stays_right(monkeypatch, slots):
    """With room for fewer names than a step submits, every round evicts and re-publishes:
    results stay right, in per-rank orders, with names coming back after their eviction, and
    the cache never holds more than its capacity."""
    from mcrdl.engine import _names

    monkeypatch.setattr(_names, "CACHE_SLOTS", slots)
    steps, n = 5, 6

    def program(comm):
        rng = np.random.default_rng(comm.rank + 7)
        bufs = [np.full(2, float(i)) for i in range(n)]
        most = 0
        for _ in range(steps):
            futs = [comm.allreduce(bufs[i], name=f"g{i}") for i in rng.permutation(n)]
            for f in futs:
                f.wait()
                most = max(most, len(comm._names.keys))
        return most, [b[0] for b in bufs]

    for most, values in _run(3, program):
        assert most <= slots
        assert values == [i * 3.0 ** steps for i in range(n)]


def test_an_operation_ready_under_an_evicted_name_is_offered_by_name_again(monkeypatch):
    """A cache of one slot: rank 0 has "a" ready under its slot when the round that agrees
    "b" gives "b" that slot; rank 1 submits "a" only after "b" finished. Rank 0 must offer
    its "a" by name again (its bit now stands for "b"), or the two never meet."""
    from mcrdl.engine import _names

    monkeypatch.setattr(_names, "CACHE_SLOTS", 1)

    def program(comm):
        x, y = np.ones(2), np.full(2, 10.0)
        comm.allreduce(np.ones(2), name="a").wait()  # "a" takes the slot
        if comm.rank == 0:
            fa = comm.allreduce(x, name="a")
            fb = comm.allreduce(y, name="b")
            fb.wait()
            fa.wait()
        else:
            comm.allreduce(y, name="b").wait()
            comm.allreduce(x, name="a").wait()
        again = np.full(2, 5.0)
        comm.allreduce(again, name="b").wait()
        return x[0], y[0], again[0], list(comm._names.keys)

    out = SimWorld(2, MPI_LIKE, seed=1, timeout=2.0).run(program)
    assert [o[:3] for o in out] == [(2.0, 20.0, 10.0)] * 2
    assert all(o[3] == [("b", o[3][0][1])] for o in out), out


@pytest.mark.parametrize("kind", ["error", "start"])
def test_a_round_failing_on_one_member_breaks_the_communicator_on_every_member(monkeypatch,
                                                                               kind):
    """Rank 0's first agreement round fails (``"error"``: it ran, then its backend reported
    a failure there; ``"start"``: it never reached the peers). Rank 0 does not know what the
    members agreed on, which the peers go on to place and issue: the named operation fails
    on every member with CommBrokenError naming the round, and so does what follows on the
    communicator. (A round that failed in flight used to leave its operations waiting here
    until the timeout, which then blamed the peers for not submitting them.)"""
    comms = {}
    real = SimWorld.fault

    def fault(world, args):
        names = comms[0]._names if 0 in comms else None
        current = names.current if names is not None else None
        if (current is not None and current.seq == 1 and current.args is not None
                and any(a is current.args[1] for a in args)):  # (its row)
            return kind
        return real(world, args)

    monkeypatch.setattr(SimWorld, "fault", fault)

    def program(comm):
        comms[comm.rank] = comm
        outcomes = []
        for name, backend in (("a", "mpi"), (None, "mpi"), (None, "gloo")):
            try:
                comm.allreduce(np.ones(4), name=name, backend=backend).wait()
                outcomes.append("done")
            except CommBrokenError as exc:
                outcomes.append(str(exc))
        return outcomes

    out = SimWorld(2, MPI_LIKE, seed=1, timeout=600.0).run(program)
    for outcomes in out:
        assert all("on rank 0, agreement#1 on mpi" in text for text in outcomes), outcomes


# -- fusion (engine._fusion) -------------------------------------------------------------

def _fused_fault(kind):
    """Three named allreduces that the agreement fuses; rank 0's second one fails as
    ``kind`` says (the fault fires on the fused allreduce that carries it). Each rank's
    outcomes, sums, and what a later allreduce of the communicator does."""
    world = SimWorld(2, MPI_LIKE, seed=1, timeout=5)

    def program(comm):
        arrays = [np.full(2, float(i + 1)) for i in range(3)]
        if comm.rank == 0:
            world.inject(kind, [arrays[1]])
        futs = [comm.allreduce(a, name=f"n{i}", backend="mpi") for i, a in enumerate(arrays)]
        outcomes = []
        for fut in futs:
            try:
                fut.wait()
                outcomes.append("done")
            except Exception as exc:  # noqa: BLE001 - what each ended with is the result
                outcomes.append(type(exc).__name__)
        try:
            later = comm.allreduce(np.ones(1), backend="mpi").wait()[0]
        except Exception as exc:  # noqa: BLE001
            later = type(exc).__name__
        return outcomes, [a[0] for a in arrays], later

    return world.run(program)


def test_a_member_failing_in_flight_fails_its_fused_group_there_and_the_rest_goes_on():
    """As with operations run one by one: a backend's failure on one rank fails what ran
    there (the whole fused allreduce), every peer gets its sums, and the communicator goes
    on (the operations ran on every member in step)."""
    (mine, _, later0), (theirs, sums, later1) = _fused_fault("error")
    assert mine == ["BackendError"] * 3
    assert theirs == ["done"] * 3 and sums == [2.0, 4.0, 6.0]
    assert later0 == later1 == 2.0


def test_a_member_failing_to_start_breaks_the_communicator_on_every_member():
    (mine, _, later0), (theirs, _, later1) = _fused_fault("start")
    assert mine == ["StartError", "CommBrokenError", "CommBrokenError"]
    assert "done" not in theirs
    assert later0 == later1 == "CommBrokenError"
