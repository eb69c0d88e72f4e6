"""The package's structure (docs/design.md §0): no import cycle (function-level imports included, so none can
hide), files and functions short enough to read at once (the package's, the benchmarks' and the scripts'), and
comments that explain the code rather than log measurements (those live in docs/benchmarks.md)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mha2mla"
ROOT = PACKAGE.parent
SHORT_FOLDERS = ("mha2mla", "benchmarks", "scripts")  # the package and the lab around it
MAX_FUNCTION_LINES = 60  # except Triton kernels (@triton.jit), whose bodies stay whole
MAX_FILE_LINES = 300  # outside mha2mla/kernels/, whose Triton forward and backward stay together


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body (``from a import b`` counts as
    a.b when that is a module, else a)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "mha2mla.convert.pipeline" in graph and "mha2mla.convert.steps.attention" in graph["mha2mla.convert.pipeline"]
    assert cycles(graph) == []


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the function is decorated ``@triton.jit`` (or ``@triton.jit(...)``)."""
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit" for d in node.decorator_list)


def long_functions(root: Path) -> list[str]:
    """Every function under ``root`` (methods and nested ones included) longer than MAX_FUNCTION_LINES, Triton
    kernels excepted."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root.parent)}:{node.name} ({length} lines)")
    return found


def long_files(root: Path, excepted: tuple[str, ...] = ()) -> list[str]:
    """Every file under ``root`` longer than MAX_FILE_LINES, outside the folders named in ``excepted``."""
    return [f"{path.relative_to(root.parent)} ({length} lines)" for path in sorted(root.rglob("*.py"))
            if not set(excepted) & set(path.relative_to(root).parts)
            and (length := len(path.read_text().splitlines())) > MAX_FILE_LINES]


@pytest.mark.parametrize("folder", SHORT_FOLDERS)
def test_functions_are_short(folder):
    assert long_functions(ROOT / folder) == []


@pytest.mark.parametrize("folder", SHORT_FOLDERS)
def test_files_are_short(folder):
    assert long_files(ROOT / folder, excepted=("kernels",) if folder == "mha2mla" else ()) == []


def test_the_length_checks_find_a_long_file_and_a_long_function(tmp_path):
    lab = tmp_path / "lab"
    (lab / "kernels").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # with its def: one line too many
    padding = "y = 0\n" * MAX_FILE_LINES
    (lab / "long.py").write_text(f"def long():\n{body}{padding}")
    (lab / "kernels" / "kernel.py").write_text(f"import triton\n\n\n@triton.jit\ndef kernel():\n{body}"
                                               f"@triton.jit(do_not_specialize=[0])\ndef other():\n{body}{padding}")
    (lab / "short.py").write_text("def short():\n    return 1\n")
    assert long_files(lab) == ["lab/kernels/kernel.py (427 lines)", "lab/long.py (361 lines)"]
    assert long_files(lab, excepted=("kernels",)) == ["lab/long.py (361 lines)"]
    assert long_functions(lab) == ["lab/long.py:long (61 lines)"]


# a measured figure: a ratio (×1.46), a duration (12 s, 3.5 min), or the word itself
FIGURE = re.compile(r"×\s?\d|\d\s?×|\bmeasured\b|\b\d+(\.\d+)?\s?(ms|s|seconds|min|minutes)\b", re.IGNORECASE)


def commentary(path: Path):
    """(line number, text) of every comment and docstring line in ``path``."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                for offset, line in enumerate(docstring.splitlines()):
                    yield node.body[0].lineno + offset, line


def figures_in_comments(root: Path) -> list[str]:
    """Comment and docstring lines under ``root`` that hold a measured figure without pointing to docs/benchmarks.md."""
    return [f"{path.relative_to(root.parent)}:{number}: {text.strip()}" for path in sorted(root.rglob("*.py"))
            for number, text in commentary(path) if FIGURE.search(text) and "docs/benchmarks.md" not in text]


def test_the_figure_finder_finds_figures(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text('"""Fast: ×1.46 on KJV."""\n# 12 s per layer\nx = 1  # a plain comment\n'
                                  '# measured better (docs/benchmarks.md)\n')
    assert [line.split(": ", 1)[0] for line in figures_in_comments(package)] == ["pkg/a.py:2", "pkg/a.py:1"]


def test_no_measured_figure_in_comments_or_docstrings():
    assert figures_in_comments(PACKAGE) == []
