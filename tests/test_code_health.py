"""The package type-checks (mypy strict) and the whole tree lints (ruff), as the style asks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def test_mypy_strict():
    proc = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_ruff():
    proc = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]


#: The packages of mcrdl from the bottom up (docs/design.md, "Layers"): a module imports only
#: from its own package and from the packages below it.
LAYERS = {"core": 0, "bootstrap": 1, "backends": 2, "engine": 3, "observe": 4, "tuning": 4,
          "front": 5, "torch": 6, "testing": 6, "": 7}
#: Backends the engine must never import, not even for types: it knows the contract only.
CONCRETE = {"mcrdl.backends.mpi", "mcrdl.backends.gloo", "mcrdl.backends.nccl",
            "mcrdl.backends.cupy_nccl", "mcrdl.backends.sim"}


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """The mcrdl modules ``path`` imports, with their lines and whether the import is for
    type checking only (under ``if TYPE_CHECKING:``)."""
    import ast

    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        module = package
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target]
            if not node.module:  # from . import x: x may be a module
                names = [f"{target}.{a.name}" for a in node.names]
        for name in names:
            if name == "mcrdl" or name.startswith("mcrdl."):
                out.append((name, node.lineno, id(node) in typing_only))
    return out


def _layer(module: str) -> str:
    """The package of mcrdl that ``module`` belongs to ("" for the top: mcrdl itself, its
    ``__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def test_imports_point_down_the_layers():
    """Each module imports from its own package and from those below it, never from above
    or beside it; imports for type checking only are free (they run nowhere). The engine
    names no concrete backend, not even for types."""
    wrong = []
    for path in sorted((ROOT / "mcrdl").rglob("*.py")):
        mine = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for name, line, typing_only in _imports(path):
            theirs = _layer(name)
            if mine == "engine" and name in CONCRETE:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: the engine imports {name}")
            if theirs == mine or LAYERS[theirs] < LAYERS[mine] or typing_only:
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine or 'mcrdl'} imports {name} "
                         f"({theirs or 'mcrdl'}), a layer above or beside it")
    assert not wrong, "\n".join(wrong)
