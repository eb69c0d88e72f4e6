"""A recipe file that does not parse, as one sentence (PyYAML's own message spans several lines with a caret)."""

from __future__ import annotations

from pathlib import Path


def yaml_error_sentence(path: str | Path, error: Exception) -> str:
    """``recipe PATH is not valid YAML (line L, column C: PROBLEM); fix that line.`` for a ``yaml.YAMLError``."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or getattr(error, "context", None) or str(error)
    problem = " ".join(str(problem).split())
    if mark is None:
        return f"recipe {path} is not valid YAML ({problem}); fix the file."
    return f"recipe {path} is not valid YAML (line {mark.line + 1}, column {mark.column + 1}: {problem}); fix that line."
