"""The documentation builds as a site (mkdocs.yml), warnings as errors: every page's links
resolve, and every public name's docstring parses (mkdocstrings reads them, Google style)."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import ROOT


def test_the_site_builds_without_a_warning(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    page = (tmp_path / "site" / "reference" / "mcrdl" / "index.html").read_text()
    for name in ("mcrdl.init", "mcrdl.Communicator.alltoallv", "mcrdl.CommFuture.wait",
                 "mcrdl.CommBrokenError"):
        assert f'id="{name}"' in page, name
