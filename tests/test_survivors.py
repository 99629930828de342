"""A rank dies and the others train on (docs/design.md, rule 9): examples/elastic.py under
``python -m mcrdl run`` loses a rank mid-step, the survivors shrink the world and end with
the parameters of a reference that trains with every rank before the loss and with the
survivors from it on. Rank 0 included (the store lives in the launcher), with one more rank
killed inside the shrink, at each round of the survivors' agreement, and through torch
(examples/elastic_ddp.py: FSDP2, or DDP, over "mcrdl", wrapped again on the survivors'
default group).
The same under Open MPI's mpiexec with its fault tolerance on (ULFM), MPI up beside gloo, and
from a given file store: the store lives in rank 0 there, and the survivors learn of the
death and agree through the connections between the ranks (`mcrdl.bootstrap._mesh`).
"""

from __future__ import annotations

import json

import pytest

from tests import died_idle
from tests.launch import NO_OPENMPI, finish, have_openmpi, start_ranks

pytestmark = pytest.mark.multirank

#: (ranks, the rank that dies mid-step, the one that dies in the shrink, and where).
JOBS = {"0 of 4, 2 in the shrink's first round": (4, 0, (2, "in")),
        "3 of 4, 1 having made its groups": (4, 3, (1, "made"))}


#: The same under Open MPI with ULFM: (ranks, who dies mid-step, who in the shrink and where,
#: the backend of the example's allreduce, the backends up). With MPI alone, the member that
#: dies after the first round is missing from MPI's shrink of the old communicator, which
#: fails that attempt everywhere.
ULFM_JOBS = {"0 of 4 on gloo, 2 in the shrink's first round": (4, 0, (2, "in"), "gloo", ""),
             "1 of 4 on MPI alone, 2 in the shrink's first round": (4, 1, (2, "in"), "mpi",
                                                                    "mpi")}


#: From a given store, nothing outside the ranks tells who died, and the store lives in
#: rank 0: (ranks, who dies mid-step, who in the shrink and where). The first survivor serves
#: the survivors' store and decides first in the mesh's agreement.
GIVEN_JOBS = {"0 of 4, 2 in the shrink's first round": (4, 0, (2, "in")),
              "0 of 4, the first survivor having made its groups": (4, 0, (1, "made"))}


def test_from_a_given_store_survivors_learn_and_agree_through_the_mesh(tmp_path):
    """Brought up from a file store (as under torch's test harness), the ranks have no
    launcher that tells who died, and mcrdl's store lives in rank 0: the survivors learn of
    deaths and agree through the connections between them (`mcrdl.bootstrap._mesh`). Also
    (tests/ranks/launched.py) rank 0 dies while the others are idle: named operations, a
    split, the flight recorder, rule 7 and the trace on the survivors."""
    idle = tmp_path / "idle"
    idle.mkdir()
    idle_job = start_ranks(3, ["tests/ranks/launched.py", "die:0", str(idle)],
                           launcher="given", env={"MCRDL_TRACE": str(idle / "trace.json"),
                                                  "MCRDL_PROGRESS_THREAD": "0"})
    started = {name: _start(tmp_path, name, *job, "given") for name, job in GIVEN_JOBS.items()}
    _check(started, 128 + 9)
    done = finish(idle_job, 90)
    log = (done.stdout + done.stderr)[-6000:]
    died_idle.check(idle, 0, [1, 2], "rank 0 is gone: its connection to this rank closed",
                    "gloo", log)


def test_a_rank_ended_by_an_uncaught_exception_is_gone_for_the_others(tmp_path):
    """From a given store (nobody outside the ranks tells): rank 1 raises out of the
    program while rank 0 waits in an allreduce with it; rank 0 fails with PeerLostError at
    once, not at its timeout (tests/ranks/raises.py: mcrdl's exit handler closes the mesh
    without a goodbye)."""
    done = finish(start_ranks(2, ["tests/ranks/raises.py", str(tmp_path)], launcher="given"),
                  90)
    log = (done.stdout + done.stderr)[-4000:]
    outcome, after = (tmp_path / "rank0.txt").read_text().split()
    assert outcome == "PeerLostError" and float(after[len("after="):]) < 5, log


def test_under_mpich_the_survivors_go_on_without_mpi_and_say_so(tmp_path):
    """MPICH cannot make a group once a process is gone: rank 0 dies, and the survivors'
    shrunk world has gloo alone, a RuntimeWarning says so, and an operation named for MPI
    there is refused naming why (tests/ranks/mpich_survivors.py). MPICH's launcher still
    ends the survivors now and then (docs/design.md, "Survivors"): the launch is repeated
    until both report."""
    for attempt in range(8):
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        done = finish(start_ranks(3, ["tests/ranks/mpich_survivors.py", str(out)],
                                  launcher="mpi-go-on"), 90)
        reports = {p.name: p.read_text() for p in out.glob("rank*.txt")}
        if len(reports) == 2:
            break
    logs = "\n".join(p.read_text()[-3000:] for p in out.glob("out*.log"))
    assert sorted(reports) == ["rank1.txt", "rank2.txt"], (done.stdout[-3000:], logs)
    for text in reports.values():
        assert "first=PeerLostError\nbackends=['gloo'] members=[1, 2]\n" in text, text
        assert "said=[\"world's survivors go on without backend(s) mpi, which cannot make a " \
               "group once members are gone" in text, text
        assert "refused=backend 'mpi' is not on this communicator: its survivors went on " \
               "without it after a loss" in text, text
        assert "sum=[3.0, 3.0] named=[2.0] split=1" in text, text


def _start(tmp_path, name, n, dies, in_shrink, launcher, extra=(), env=None):
    out = tmp_path / name.replace(" ", "_").replace(",", "").replace("'", "")
    out.mkdir()
    example = ["--die-rank", str(dies), "--die-step", "3", "--out", str(out), *extra]
    argv = (["examples/elastic.py", *example] if in_shrink is None else
            ["tests/ranks/shrink_death.py", str(in_shrink[0]), in_shrink[1], *example])
    return start_ranks(n, argv, launcher=launcher, env=env), out, n, dies, in_shrink


def test_the_survivors_shrink_and_end_as_the_reference(tmp_path):
    # Through torch as well: FSDP2 over "mcrdl" loses rank 0, which held the weight's one
    # row (the store it was started from is the launcher's, not rank 0's); the survivors'
    # default group is remade, and the model sharded again from the full weight they kept.
    fsdp = start_ranks(3, ["examples/elastic_ddp.py", "--die-rank", "0", "--die-step", "3",
                           "--fsdp"], launcher="mcrdl")
    started = {name: _start(tmp_path, name, *job, "mcrdl") for name, job in JOBS.items()}
    _check(started, 128 + 9)
    _check_torch(fsdp, 128 + 9)


@pytest.mark.skipif(not have_openmpi(), reason=NO_OPENMPI)
def test_under_open_mpi_with_ulfm_the_survivors_shrink_and_end_as_the_reference(tmp_path):
    """Also (tests/ranks/launched.py): rank 0, whose process served the store, dies while
    the others have nothing in flight; their next allreduce fails at once with
    PeerLostError, they shrink, and a named operation, a split (its gloo groups made through
    the survivors' store), the flight recorder and the trace work on the survivors."""
    idle = tmp_path / "idle"
    idle.mkdir()
    idle_job = start_ranks(3, ["tests/ranks/launched.py", "die:0", str(idle)],
                           launcher="openmpi", env={"MCRDL_TRACE": str(idle / "trace.json"),
                                                    "MCRDL_PROGRESS_THREAD": "0"})
    # DDP over "mcrdl" (MPI and gloo up): torch's default group remade on the survivors'
    # store, rank 0's having gone with it.
    ddp = start_ranks(3, ["examples/elastic_ddp.py", "--die-rank", "0", "--die-step", "3"],
                      launcher="openmpi")
    started = {name: _start(tmp_path, name, n, dies, in_shrink, "openmpi",
                            ["--backend", backend], {"MCRDL_BACKENDS": up} if up else None)
               for name, (n, dies, in_shrink, backend, up) in ULFM_JOBS.items()}
    _check(started, None)
    done = finish(idle_job, 90)
    log = (done.stdout + done.stderr)[-6000:]
    died_idle.check(idle, 0, [1, 2], "rank 0 is gone: its connection to this rank closed",
                    "mpi", log)
    _check_torch(ddp, None)


def _check_torch(proc, exit_status):
    """examples/elastic_ddp.py lost rank 0 of 3, and its survivors match the reference."""
    done = finish(proc, 90)
    log = (done.stdout + done.stderr)[-6000:]
    assert exit_status is None or done.returncode == exit_status, log
    assert "survivors [1, 2] of 3: the parameters match the reference" in done.stdout, log


def _check(started, exit_status, stdout=True):
    """Every survivor of each job ends with the reference's parameters, soon after the
    loss; the job ends with ``exit_status`` (None: any). ``stdout``: the survivors' output
    reaches the launcher's (MPICH's stops passing it on after a death)."""
    for name, (proc, out, n, dies, in_shrink) in started.items():
        done = finish(proc, 90)
        log = (done.stdout + done.stderr)[-6000:]
        assert exit_status is None or done.returncode == exit_status, f"{name}:\n{log}"
        gone = {dies} | ({in_shrink[0]} if in_shrink else set())
        survivors = sorted(set(range(n)) - gone)
        ends = {r: json.loads((out / f"rank{r}.json").read_text())
                for r in range(n) if (out / f"rank{r}.json").exists()}
        assert sorted(ends) == survivors, f"{name}:\n{log}"
        for end in ends.values():
            assert end["members"] == survivors and end["match"], f"{name}: {end}\n{log}"
        assert len({tuple(end["w"]) for end in ends.values()}) == 1, name
        # Going on takes a moment (a new store connection can take 5 s here), not a
        # timeout (the jobs' MCRDL_TIMEOUT, and so gloo's, is 30 s).
        killed = float((out / "killed_at").read_text())
        for end in ends.values():
            assert end["first_step_after"] - killed < 15, f"{name}: {end}\n{log}"
        assert not stdout or "the parameters match the reference" in done.stdout, (
            f"{name}:\n{log}")
