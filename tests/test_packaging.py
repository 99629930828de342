"""The built wheel beside a user's own torch: pip keeps it.

A venv holds a torch of another build and version (2.11.0+cu130, as a GPU user has) and the
other requirements, each as installed distribution metadata; pip's resolver, offline, is asked
to install mcrdl's wheel there. Within mcrdl's range the torch stays and nothing but mcrdl is
installed; below it, pip asks for another torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.launch import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = out.glob("mcrdl-*.whl")
    return found


def _requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1]) for line in lines
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None]  # the extras' are marked


def _installed(site: Path, name: str, version: str) -> Path:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    return info


@pytest.fixture(scope="module")
def env(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """A venv holding every requirement of the wheel but torch, each at the lowest version
    it allows; its python and its site-packages."""
    env_dir = tmp_path_factory.mktemp("env")
    venv.create(env_dir, with_pip=True)
    (site,) = env_dir.glob("lib/python*/site-packages")
    for req in _requirements(wheel):
        if req.name != "torch":
            lows = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
            _installed(site, req.name, lows[0] if lows else "1.0")
    return env_dir / "bin" / "python", site


def _plan(wheel: Path, env: tuple[Path, Path], tmp: Path,
          torch_version: str) -> subprocess.CompletedProcess[str]:
    """What pip would install from ``wheel`` into ``env`` with torch ``torch_version``."""
    python, site = env
    torch_info = _installed(site, "torch", torch_version)
    report = tmp / "report.json"
    # Offline, and blind to this machine's pip configuration (its wheel directories).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean["PIP_CONFIG_FILE"] = os.devnull
    try:
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--dry-run",
                               "--no-index", "--report", str(report), str(wheel)],
                              capture_output=True, text=True, timeout=300, env=clean)
    finally:
        shutil.rmtree(torch_info)
    proc.stdout = report.read_text() if report.exists() else ""
    return proc


def test_a_users_torch_stays(wheel, env, tmp_path):
    reqs = {r.name: r for r in _requirements(wheel)}
    assert "mpich" not in reqs  # MPICH from PyPI only as an extra: a site's MPI stays too
    proc = _plan(wheel, env, tmp_path, "2.11.0+cu130")
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = [i["metadata"]["name"] for i in json.loads(proc.stdout)["install"]]
    assert planned == ["mcrdl"], planned


def test_a_torch_below_the_range_is_not_taken(wheel, env, tmp_path):
    proc = _plan(wheel, env, tmp_path, "2.10.0")
    assert proc.returncode != 0
    assert "No matching distribution found for torch<2.14,>=2.11" in proc.stderr, proc.stderr
