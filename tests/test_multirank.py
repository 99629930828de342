"""The multi-rank suites, each run in one launch per world size (2 and 4 ranks)."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys

import pytest

from tests.launch import NO_OPENMPI, ROOT, have_openmpi, run_ranks, run_suite

pytestmark = pytest.mark.multirank


#: Suites whose 4-rank run is in the slow set only: their 2-rank run keeps their checks in
#: the default set, whose 4-rank launches (the contract, semantics, faults, named, programs,
#: torch and pipeline suites; the first five on Open MPI) already run every operation at 4
#: ranks; each launch of 4 ranks on two cores costs many seconds.
FOUR_SLOW = [2, pytest.param(4, marks=pytest.mark.slow)]


#: Open MPI, with its fault tolerance on (ULFM), beside the venv's MPICH: mcrdl runs on both.
OPEN_MPI = pytest.mark.skipif(not have_openmpi(), reason=NO_OPENMPI)


@pytest.mark.parametrize("n,launcher", [
    (2, "mpi"), pytest.param(4, "openmpi", marks=OPEN_MPI),
    pytest.param(4, "mpi", marks=pytest.mark.slow), pytest.param(2, "openmpi", marks=[
        OPEN_MPI, pytest.mark.slow])])
def test_contract(n, launcher):
    # Every dtype at 2 ranks; at 4 (oversubscribed) every operation on both backends with
    # the dtypes that take distinct paths (MPI's own types, bfloat16 and float16 reduced in
    # Python, 64-bit integers, bool), and the rest of the suite. On MPICH at 2 ranks, on Open
    # MPI at 4, in the default set; the other two in the slow set.
    extra = (["-k", "float32 or int64 or float16 or bool or barrier or mebibyte"] if n == 4
             else None)
    run_suite(n, "tests/multirank/test_contract.py", extra=extra, launcher=launcher)


#: Suites that need only a world: one launch per size runs them all (a launch costs seconds
#: of imports on every rank, and each module has a communicator of its own: a failed one
#: cannot desync the next).
SUITES = ["tests/multirank/test_semantics.py", "tests/multirank/test_faults.py",
          "tests/multirank/test_named.py", "tests/multirank/test_programs.py",
          "tests/multirank/test_torch_backend.py"]


@pytest.mark.parametrize("n,launcher", [
    (2, "mpi"), pytest.param(4, "openmpi", marks=OPEN_MPI),
    pytest.param(4, "mpi", marks=pytest.mark.slow),
    pytest.param(2, "openmpi", marks=[OPEN_MPI, pytest.mark.slow])])
def test_semantics_faults_named_programs_and_the_torch_backend(n, launcher):
    # As the contract: MPICH at 2 ranks and Open MPI at 4 in the default set (4 ranks on
    # two cores took 53 s under MPICH, 21-25 s under Open MPI), the other two in the slow set.
    run_suite(n, SUITES, launcher=launcher)


def _overlap(progress_thread: str, env: dict[str, str] | None = None) -> list[str]:
    proc = run_ranks(2, ["tests/ranks/overlap_check.py"], timeout=120,
                     env={"MCRDL_PROGRESS_THREAD": progress_thread, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.findall(r"overlap rank=\d+ mpi_done=\w+ gloo_done=\w+", proc.stdout)


def test_communication_advances_during_compute():
    lines = _overlap("1")
    assert len(lines) == 2 and all("mpi_done=True gloo_done=True" in line for line in lines), lines


def test_without_the_progress_thread_nothing_advances_during_compute():
    """The negative control: the check above fails when the guarantee is switched off."""
    lines = _overlap("0")
    assert len(lines) == 2 and all("mpi_done=False gloo_done=False" in line for line in lines), lines


def test_under_torchrun_gloo_only():
    proc = run_ranks(2, ["tests/ranks/torchrun_check.py"], timeout=120, launcher="torchrun")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("size=2 ok") == 2, out[-6000:]


def test_torch_finds_mcrdl_without_an_import_of_it():
    """``dist.init_process_group("mcrdl")`` in a program that never imports mcrdl, under
    torchrun: torch's "torch.backends" entry point registered the name (pyproject.toml)."""
    proc = run_ranks(2, ["tests/ranks/torch_entry_check.py"], timeout=120,
                     launcher="torchrun")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("size=2 ok") == 2, out[-6000:]


def test_a_dead_peer_makes_every_survivor_raise_and_nothing_hangs(tmp_path):
    """kill -9 of one rank: survivors raise within the timeout, naming it; the job ends;
    nothing is left.

    Hydra sometimes ends survivors itself right after the death, even with
    -disable-auto-cleanup (a raw mpi4py program shows the same; here both survivors lived
    in about half the launches); a survivor it ended cannot raise, so the launch is repeated
    until both survivors report.
    Every launch must end promptly and leave no process behind.
    """
    import subprocess
    import time

    from tests.launch import ROOT, mpiexec

    script = "tests/ranks/dead_peer.py"
    reports: list[str] = []
    for attempt in range(15):  # both survivors lived in 5 launches of 10 here
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        env = dict(os.environ, MCRDL_TIMEOUT="3", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   MCRDL_RESULT_DIR=str(out))
        t0 = time.monotonic()
        subprocess.run([mpiexec(), "-disable-auto-cleanup", "-n", "3", sys.executable, script],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert time.monotonic() - t0 < 60
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-f", script], capture_output=True, text=True).stdout
        assert left.strip() == "", f"processes left behind: {left}"
        reports = [p.read_text().strip() for p in sorted(out.glob("rank*.txt"))]
        if len(reports) == 2:
            break
    assert len(reports) == 2, reports
    for line in reports:
        mpi, gloo, after = re.search(r"mpi=(\w+) gloo=(\w+) after=([\d.]+)", line).groups()
        # The mesh between the ranks tells who died (MPICH's own signal names nobody): both
        # operations fail with PeerLostError, the MPI one though MPICH never ends it.
        assert mpi in ("PeerLostError", "CommTimeoutError"), line
        assert gloo in ("BackendError", "CommTimeoutError", "PeerLostError"), line
        assert float(after) < 3 + 5, line  # within the timeout (plus slack)




@pytest.mark.parametrize("n", FOUR_SLOW)
def test_debug_mode(n):
    run_suite(n, "tests/multirank/test_debug.py", env={"MCRDL_DEBUG": "1"})


def _replay_example(tmp_path) -> subprocess.CompletedProcess[str]:
    paths = sorted(str(p) for p in tmp_path.glob("step-*.json"))
    return subprocess.run([sys.executable, "examples/pipeline_step.py", "--replay", *paths],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("n", [2, 4])
def test_the_pipeline_example_trains_and_its_recordings_replay(n, tmp_path):
    """examples/pipeline_step.py on real ranks, each recording what it submitted and waited
    for: every rank's losses are right, and the recordings replay on their ranks in the
    simulated world under both semantics."""
    proc = run_ranks(n, ["examples/pipeline_step.py", "--record",
                         str(tmp_path / "step-{rank}.json")], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("(right)") == n, proc.stdout[-4000:]
    replayed = _replay_example(tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "the recorded step passes" in replayed.stdout


def test_a_real_step_that_skips_a_collective_is_recorded_and_replays_into_its_deadlock(
        tmp_path):
    """Stage 1 skips the world allreduce: the real run times out, each rank's recording is
    saved all the same, and the replay names the allreduce and the rank that lacks it."""
    proc = run_ranks(2, ["examples/pipeline_step.py", "--bug", "skip", "--record",
                         str(tmp_path / "step-{rank}.json")], timeout=120,
                     env={"MCRDL_TIMEOUT": "3"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CommTimeoutError" in out, out[-4000:]
    assert "unmatched message" not in out, out[-4000:]
    replayed = _replay_example(tmp_path)
    assert replayed.returncode != 0
    assert "SimDeadlock" in replayed.stderr, replayed.stderr
    assert re.search(r"mpi:world allreduce #\d+: ranks \[1\] have not issued it",
                     replayed.stderr), replayed.stderr


@pytest.mark.parametrize("n", FOUR_SLOW)
def test_examples_train_like_one_process(n):
    # At 4 ranks (oversubscribed; the slow set) every backend and DDP, with overlap only.
    extra = ["-k", "not False"] if n == 4 else None
    run_suite(n, "tests/multirank/test_examples.py", extra=extra)


def _unephemeral_port() -> int:
    """A free port below the kernel's ephemeral range, for a server that a launched rank
    binds later. A port the kernel hands out for port 0 comes from that range, from which
    every outgoing connection (the launcher's, gloo's) draws its local port too: once,
    between the check and the launch, one took it, and torch's store failed to listen on
    it (EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


def test_torch_distributed_backend_errors():
    """torch first under mpiexec (env:// from the MPI launcher's rank and size), debug mode:
    a desync and a timeout surface through Work.wait()."""
    port = _unephemeral_port()
    run_suite(2, "tests/multirank/test_torch_errors.py",
              env={"MCRDL_DEBUG": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def test_torch_distributed_backend_from_a_file_store(tmp_path):
    """Plain processes and a FileStore, as torch's own test harness runs ranks."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE")}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MCRDL_TIMEOUT": "30"})
    procs = [subprocess.Popen([sys.executable, "tests/ranks/torch_store_check.py",
                               str(tmp_path / "store"), str(r), "2"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank={r} size=2 ok" in out, out[-4000:]


def test_torch_distributed_backend_started_by_torch_under_torchrun():
    """dist.init_process_group("mcrdl") first, from torchrun's env:// store: mcrdl comes up
    from it (gloo only), and the suite runs again (what needs MPI skips). On every rank,
    every test the suite holds either passed or skipped because MPI is not up: none failed,
    errored or went missing."""
    suite = "tests/multirank/test_torch_backend.py"
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                "-p", "no:cacheprovider", suite],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
    total = int(re.search(r"^(\d+) tests collected", collected.stdout, re.M)[1])
    out = run_suite(2, suite, launcher="torchrun", env={"MCRDL_TORCH_FIRST": "1"},
                    extra=["-rs"])
    for rank in range(2):
        [(passed, skipped)] = re.findall(
            rf"^\[default{rank}\]:(\d+) passed(?:, (\d+) skipped)? in ", out, re.M) or [(0, 0)]
        skips = re.findall(rf"^\[default{rank}\]:SKIPPED \[(\d+)\] \S+: (.*)$", out, re.M)
        assert int(passed) + int(skipped or 0) == total and int(passed) > 0, out[-4000:]
        assert sum(int(k) for k, _ in skips) == int(skipped or 0), out[-4000:]
        assert {why for _, why in skips} <= {"['mpi'] not up under this launcher"}, out[-4000:]


def _synthetic_table(path, other=False):
    from mcrdl.tuning import Entry, TuningTable

    entries = []
    for op in ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter",
               "reduce_scatter", "alltoall", "alltoallv"):
        for dtype in ("float32", "int64", "bfloat16"):
            for n in (1, 2, 3, 4):
                entries += [Entry(op, dtype, n, 0, 256, "gloo"),
                            Entry(op, dtype, n, 256, 4096, "mpi"),
                            Entry(op, dtype, n, 4096, None, "gloo" if not other else "mpi")]
    TuningTable(entries, {"purpose": "test"}).save(str(path))


@pytest.mark.parametrize("n", FOUR_SLOW)
def test_auto_under_a_tuning_table(n, tmp_path):
    path = tmp_path / "table.json"
    _synthetic_table(path)
    run_suite(n, "tests/multirank/test_auto.py", env={"MCRDL_TUNING": str(path)})


def test_ranks_with_different_tables_are_refused_everywhere(tmp_path):
    base = tmp_path / "table.json"
    _synthetic_table(base)
    _synthetic_table(str(base) + ".other", other=True)
    proc = run_ranks(2, ["tests/ranks/tuning_mismatch.py"], timeout=120,
                     env={"MCRDL_TUNING_BASE": str(base)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    refusals = re.findall(r"refused rank=\d: ranks do not hold the same tuning table: "
                          r"rank 0: [0-9a-f]{12}; rank 1: [0-9a-f]{12}", out)
    assert len(refusals) == 2, out[-4000:]


def test_a_rank_without_a_table_is_refused_everywhere(tmp_path):
    """Rank 1 starts with no table: it still runs the check the others run (else their
    check would be matched with its first collective), and every rank refuses."""
    base = tmp_path / "table.json"
    _synthetic_table(base)
    proc = run_ranks(2, ["tests/ranks/tuning_mismatch.py"], timeout=120,
                     env={"MCRDL_TUNING_BASE": str(base), "MCRDL_TUNING_RANK1": "none"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    refusals = re.findall(r"refused rank=\d: ranks do not hold the same tuning table: "
                          r"rank 0: [0-9a-f]{12}; rank 1: none;", out)
    assert len(refusals) == 2, out[-4000:]


def test_ranks_with_different_fusion_limits_are_refused_everywhere():
    """Members that fuse differently would run different collectives: init() compares
    ``fusion_bytes`` (rank 1 turns fusion off here) and every rank refuses."""
    proc = run_ranks(2, ["tests/ranks/tuning_mismatch.py"], timeout=120,
                     env={"MCRDL_FUSION_RANK1": "0"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    refusals = re.findall(r"refused rank=\d: ranks do not have the same fusion_bytes: "
                          r"rank 0: 1048576; rank 1: 0;", out)
    assert len(refusals) == 2, out[-4000:]


def test_a_rank_that_cannot_read_its_table_is_refused_everywhere(tmp_path):
    base = tmp_path / "table.json"
    _synthetic_table(base)  # rank 1 looks for table.json.other, which does not exist
    proc = run_ranks(2, ["tests/ranks/tuning_mismatch.py"], timeout=120,
                     env={"MCRDL_TUNING_BASE": str(base)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert len(re.findall(r"refused rank=\d: ranks do not hold the same tuning table \(cannot "
                          r"read tuning table", out)) == 1, out[-4000:]
    assert len(re.findall(r"refused rank=\d: ranks do not hold the same tuning table", out)) == 2


def test_the_comms_log_and_trace_of_a_real_run(tmp_path):
    """MCRDL_LOG and MCRDL_TRACE at 2 ranks: the log's summary (checked inside the ranks),
    and the trace rank 0 writes at finalize: a process per rank, a track per lane, the
    dependency arrow, the user spans, and clocks that agree (both ranks finish each blocking
    allreduce at about the same moment on the aligned clock)."""
    import json

    trace = tmp_path / "trace.json"
    out = run_suite(2, "tests/multirank/test_observe.py", extra=["-s"],
                    env={"MCRDL_LOG": "1", "MCRDL_TRACE": str(trace)})
    assert out.count("mcrdl comms log") == 1 + 2  # rank 0's at finalize; log_summary()'s
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    for rank in (0, 1):
        assert {(rank, "user spans"), (rank, "lane mpi:world"), (rank, "lane gloo:world")} <= names
    spans = [e for e in events if e.get("cat") == "span" and e["name"] == "step"]
    assert len(spans) == 2 * 10
    starts = [e for e in events if e["ph"] == "s"]  # two arrows per step and rank, mostly
    assert len(starts) >= 2 * 10 and len(starts) == len([e for e in events if e["ph"] == "f"])
    assert all(b is not None and b < 5000 for b in doc["otherData"]["clock_skew_bound_us"])
    ends: dict[tuple[int, int], float] = {}
    for e in events:
        if e.get("cat") == "mpi" and e["name"] == "allreduce" and e["args"]["bytes"] == 12000:
            ends[(e["pid"], e["args"]["seq"])] = e["ts"] + e["dur"]
    pairs = [(ends[(0, s)], ends[(1, s)]) for (p, s) in ends if p == 0 and (1, s) in ends]
    assert len(pairs) == 10
    assert sorted(abs(a - b) for a, b in pairs)[5] < 2000, pairs  # µs; median of 10


def test_logging_leaves_the_overlap_unchanged():
    lines = _overlap("1", {"MCRDL_LOG": "1"})
    assert len(lines) == 2 and all("mpi_done=True gloo_done=True" in line for line in lines), lines


def _stuck(tmp_path, mode: str, n: int, signal: bool = True) -> tuple[str, dict]:
    """Run tests/ranks/stuck.py ``mode`` on ``n`` ranks, dump every rank's flight
    recorder by SIGUSR2 while they are stuck (else only as the ranks fail: a timeout of 3 s),
    and return ``trace explain``'s report (with the ages of operations, which vary, written
    ``…``) and the dumps it read."""
    import time

    from mcrdl.observe import load_dumps
    from tests.launch import mpiexec

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               MCRDL_TIMEOUT="8" if signal else "3",
               MCRDL_RESULT_DIR=str(tmp_path),
               MCRDL_FLIGHT_RECORDER=str(tmp_path / "fr-{rank}.json"))
    script = "tests/ranks/stuck.py"
    proc = subprocess.Popen([mpiexec(), "-n", str(n), sys.executable, script, mode], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("stuck*"))) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # into their waits
        if signal:
            ranks = f"^{sys.executable} {script}"
            subprocess.run(["pkill", "-USR2", "-f", ranks], check=False)
            # Once every rank has written its dump, nothing more is needed of them: no
            # waiting for their timeout (which would only append its own dump of the same
            # unfinished operations).
            while time.monotonic() < deadline and not all(
                    p.exists() and p.read_text().endswith("\n")
                    for p in (tmp_path / f"fr-{r}.json" for r in range(n))):
                time.sleep(0.1)
            subprocess.run(["pkill", "-KILL", "-f", ranks], check=False)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    dumps = sorted(str(p) for p in tmp_path.glob("fr-*.json"))
    assert len(dumps) == n, out[-4000:]
    report = subprocess.run([sys.executable, "-m", "mcrdl", "trace", "explain", *dumps],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    return re.sub(r"issued, \d+\.\d s\)", "issued, … s)", report.stdout), load_dumps(dumps)


def _positions(dumps: dict) -> dict:
    """Per rank: its lanes that it submitted to, as (submitted, [(op, seq, index) of each
    unfinished operation]), and the operations it is blocked on, as (lane, op, seq, index)."""
    return {rank: ({lane["lane"]: (lane["submitted"],
                                   [(o["op"], o["seq"], o["index"]) for o in lane["unfinished"]])
                    for lane in doc["lanes"] if lane["submitted"]},
                   [(o["lane"], o["op"], o["seq"], o["index"]) for o in doc["waiting_on"]])
            for rank, doc in dumps.items()}


_CYCLE = ("a cycle: rank 0 -> rank 1 -> rank 0: each waits for an operation the next has not"
          " issued (blocking waits in orders that differ between the ranks)")


def test_explain_names_the_collective_a_rank_skipped_and_what_it_waits_on(tmp_path):
    # On each communicator: its split's allgathers (mpi), a gloo allreduce, an mpi allreduce,
    # then the stuck one: its number there (#5) is not its position on the mpi lane (4).
    report, dumps = _stuck(tmp_path, "skip", 3)
    assert _positions(dumps) == {
        0: ({"mpi:world": (4, [("allreduce", 5, 4)]), "gloo:world": (1, []),
             "gloo:world.1c0": (1, [])},
            [("mpi:world", "allreduce", 5, 4)]),
        1: ({"mpi:world": (3, []), "gloo:world": (1, []), "gloo:world.1c0": (1, []),
             "mpi:world.1c0": (1, [("allreduce", 2, 1)])},
            [("mpi:world.1c0", "allreduce", 2, 1)]),
        2: ({"mpi:world": (4, [("allreduce", 5, 4)]), "gloo:world": (1, [])},
            [("mpi:world", "allreduce", 5, 4)]),
    }, dumps
    assert report == "\n".join([
        "dumps of ranks [0, 1, 2] (world of 3)",
        "",
        "stuck: allreduce#5 at position 4 of lane mpi:world (communicator world, members"
        " [0, 1, 2])",
        "  issued by ranks [0, 2]",
        "  not arrived: rank 1 (it submitted 3 operation(s) on this lane); it is blocked"
        " waiting for allreduce#2 on mpi:world.1c0 (issued, … s)",
        "",
        "stuck: allreduce#2 at position 1 of lane mpi:world.1c0 (communicator world.1c0,"
        " members [0, 1])",
        "  issued by ranks [1]",
        "  not arrived: rank 0 (it submitted 0 operation(s) on this lane); it is blocked"
        " waiting for allreduce#5 on mpi:world (issued, … s)",
        "",
        _CYCLE,
        "",
    ]), report


def test_explain_finds_a_cycle_of_blocking_waits_across_communicators(tmp_path):
    report, dumps = _stuck(tmp_path, "cycle", 2)
    lanes = {"mpi:world": (4, []), "gloo:world": (1, []), "gloo:world.1c0": (1, []),
             "gloo:world.2c0": (1, [])}
    assert _positions(dumps) == {
        0: ({**lanes, "mpi:world.1c0": (1, [("allreduce", 2, 1)])},
            [("mpi:world.1c0", "allreduce", 2, 1)]),
        1: ({**lanes, "mpi:world.2c0": (1, [("allreduce", 2, 1)])},
            [("mpi:world.2c0", "allreduce", 2, 1)]),
    }, dumps
    assert report == "\n".join([
        "dumps of ranks [0, 1] (world of 2)",
        "",
        "stuck: allreduce#2 at position 1 of lane mpi:world.1c0 (communicator world.1c0,"
        " members [0, 1])",
        "  issued by ranks [0]",
        "  not arrived: rank 1 (it submitted 0 operation(s) on this lane); it is blocked"
        " waiting for allreduce#2 on mpi:world.2c0 (issued, … s)",
        "",
        "stuck: allreduce#2 at position 1 of lane mpi:world.2c0 (communicator world.2c0,"
        " members [0, 1])",
        "  issued by ranks [1]",
        "  not arrived: rank 0 (it submitted 0 operation(s) on this lane); it is blocked"
        " waiting for allreduce#2 on mpi:world.1c0 (issued, … s)",
        "",
        _CYCLE,
        "",
    ]), report


def _reasons(tmp_path) -> dict[int, str]:
    """Each rank's dump reasons, in order."""
    import json

    return {int(p.stem.split("-")[1]): [json.loads(line)["reason"]
                                        for line in p.read_text().splitlines()]
            for p in tmp_path.glob("fr-*.json")}


def test_receives_head_to_head_dump_on_both_ranks_and_explain_names_peers_and_tags(tmp_path):
    """Each rank receives before it sends. Rank 0 times out (its dump); rank 1, whose
    timeout is 60 s, learns of the break from rank 0's notice and dumps too, before its
    receive fails: the report names both receives with their peer and tag, the sends not
    posted, and the cycle."""
    report, dumps = _stuck(tmp_path, "recv", 2, signal=False)
    reasons = _reasons(tmp_path)
    assert reasons[0][0].startswith("1 operation(s) timed out: "), reasons
    assert reasons[1][0].startswith("communicator world broken by rank 0: "), reasons
    assert report == "\n".join([
        "dumps of ranks [0, 1] (world of 2)",
        "",
        "stuck: recv#4 on rank 0 from rank 1, tag 7, on lane mpi:world (communicator world,"
        " issued, … s)",
        "  rank 1 has not posted its send with tag 7; it is blocked waiting for recv#4 on"
        " mpi:world (issued, … s)",
        "",
        "stuck: recv#4 on rank 1 from rank 0, tag 9, on lane mpi:world (communicator world,"
        " issued, … s)",
        "  rank 0 has not posted its send with tag 9; it is blocked waiting for recv#4 on"
        " mpi:world (issued, … s)",
        "",
        _CYCLE,
        "",
    ]), report


def test_a_collective_one_rank_blocks_in_and_a_receive_the_other_blocks_in_are_a_cycle(
        tmp_path):
    report, dumps = _stuck(tmp_path, "collrecv", 2, signal=False)
    assert _reasons(tmp_path)[1][0].startswith("communicator world broken by rank 0: ")
    assert report == "\n".join([
        "dumps of ranks [0, 1] (world of 2)",
        "",
        "stuck: allreduce#4 at position 3 of lane mpi:world (communicator world, members"
        " [0, 1])",
        "  issued by ranks [0]",
        "  not arrived: rank 1 (it submitted 2 operation(s) on this lane); it is blocked"
        " waiting for recv#4 on gloo:world (issued, … s)",
        "",
        "stuck: recv#4 on rank 1 from rank 0, tag 1, on lane gloo:world (communicator world,"
        " issued, … s)",
        "  rank 0 has not posted its send with tag 1; it is blocked waiting for allreduce#4"
        " on mpi:world (issued, … s)",
        "",
        _CYCLE,
        "",
    ]), report


def test_a_gloo_collective_times_out_by_the_runtime_first_with_its_dump(tmp_path):
    """gloo has a deadline of its own: equal to the runtime's timeout, it fired first (a
    BackendError "Timed out waiting", no dump, no break told to the peers)."""
    report, dumps = _stuck(tmp_path, "gloo", 2, signal=False)
    reasons = _reasons(tmp_path)
    assert reasons[0][0].startswith("1 operation(s) timed out: <CommFuture allreduce#"), reasons
    assert reasons[1][0].startswith("communicator world broken by rank 0: "), reasons
    assert "stuck: allreduce#4 at position 2 of lane gloo:world" in report, report


def test_messages_no_receive_matched_are_reported_at_close_and_at_exit():
    """MPI refuses to free a communicator holding messages no receive matched: an explicit
    close raises a BackendError saying so, and finalize at exit reports it in one line and
    goes on (it raised mpi4py's error, then failed again on the invalidated handle)."""
    proc = run_ranks(2, ["tests/ranks/unmatched.py"], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"rank 1 close: closing communicator world\.1c0: MPI cannot free it \("
                     r"Communicator \(handle=\w+\) being freed has 4 unmatched message\(s\)\): "
                     r"messages sent to this rank on it were never received", out), out[-4000:]
    assert re.search(r"mcrdl: closing communicator world\.2c0: MPI cannot free it", out), \
        out[-4000:]
    assert "mpi4py.MPI.Exception" not in out and "Invalid communicator" not in out, out[-4000:]
    assert out.count(" done") == 2, out[-4000:]
