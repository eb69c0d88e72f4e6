"""The lab around the package: ``scripts/`` are entry points that nothing imports, and every benchmark script is
listed in benchmarks/README.md and answers ``--help`` (its heavy imports stay inside the functions that need them)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
HELP_TIMEOUT_S = 60  # a hang guard only; a slow import at module level is caught by the import check below
# imports that take seconds (transformers ~1 s, the package's model code ~9 s on a 2-core CPU) stay inside functions;
# torch (~2 s) may be imported at the top
HEAVY_MODULES = ("transformers", "accelerate", "peft", "lm_eval", "datasets", "triton", "mha2mla")


def imported_roots(path: Path) -> set[str]:
    """The first component of every module ``path`` imports, anywhere in its body."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_nothing_imports_the_scripts_folder():
    python_files = [path for folder in ("mha2mla", "tests", "benchmarks") for path in (ROOT / folder).rglob("*.py")]
    importers = [str(path.relative_to(ROOT)) for path in python_files if "scripts" in imported_roots(path)]
    assert python_files and importers == []
    assert not (ROOT / "scripts" / "__init__.py").exists()


def test_benchmarks_import_heavy_modules_lazily():
    """A benchmark imports the package and transformers inside the functions that use them, so ``--help`` is quick."""
    eager = {}
    for path in BENCHMARKS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        roots = {alias.name.split(".")[0] for node in top if isinstance(node, ast.Import) for alias in node.names}
        roots |= {node.module.split(".")[0] for node in top if isinstance(node, ast.ImportFrom) and node.module}
        if roots & set(HEAVY_MODULES):
            eager[path.name] = sorted(roots & set(HEAVY_MODULES))
    assert eager == {}


def test_every_benchmark_is_listed_in_the_readme():
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = [path.name for path in (ROOT / "benchmarks").iterdir() if path.suffix in (".py", ".sh")]
    assert "harness.py" in scripts
    assert [name for name in scripts if f"`{name}`" not in readme and f"benchmarks/{name}" not in readme] == []


def _help(path: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=ROOT,
                          env=environment, timeout=HELP_TIMEOUT_S)


@pytest.fixture(scope="module")
def help_results() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip((path.name for path in BENCHMARKS), pool.map(_help, BENCHMARKS)))


@pytest.mark.parametrize("name", [path.name for path in BENCHMARKS])
def test_every_benchmark_answers_help(help_results, name):
    result = help_results[name]
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
