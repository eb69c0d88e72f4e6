"""A recipe file that does not parse (PyYAML's own message spans several lines with a caret) or does not have a
recipe's shape, as one sentence."""

from __future__ import annotations

from pathlib import Path

from mha2mla import UserError

# A recipe holds tens of settings; a file that expands to more is an anchor used inside itself or aliases of
# aliases, which would otherwise recurse forever or multiply without bound when the values are copied.
MAX_RECIPE_VALUES = 100_000


def yaml_error_sentence(path: str | Path, error: Exception) -> str:
    """``recipe PATH is not valid YAML (line L, column C: PROBLEM); fix that line.`` for a ``yaml.YAMLError``."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or getattr(error, "context", None) or str(error)
    problem = " ".join(str(problem).split())
    if mark is None:
        return f"recipe {path} is not valid YAML ({problem}); fix the file."
    return f"recipe {path} is not valid YAML (line {mark.line + 1}, column {mark.column + 1}: {problem}); fix that line."


def _shown(value) -> str:
    """A YAML value as a sentence names it: text quoted, a list or mapping by its kind, the rest as written."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    return f"the {type(value).__name__} {value}"


def _check_size(path: Path, data) -> None:
    """Refuse a recipe whose values, aliases followed, number more than MAX_RECIPE_VALUES (walked without
    recursion, so a cycle stops at the cap)."""
    stack, count = [data], 0
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_RECIPE_VALUES:
            raise UserError(f"recipe {path} expands to more than {MAX_RECIPE_VALUES:,} values (an anchor used inside "
                            "itself, or aliases of aliases); write its settings out without aliases.")
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def check_recipe_shape(path: Path, data) -> None:
    """What ``yaml.safe_load`` gave for the recipe at ``path``: a non-empty mapping of bounded size whose
    ``source:``, when given, is text naming a model; one sentence otherwise."""
    if data is None or data == {}:
        raise UserError(f"recipe {path} is empty; give `source:` and a section per command (convert:, recover:, eval:, "
                        "generate:), as the recipes in recipes/ do.")
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} is not a mapping of `source:` and command sections; see recipes/ for examples.")
    _check_size(path, data)
    source = data.get("source")
    if source is not None and not isinstance(source, str):
        raise UserError(f"recipe {path}: `source:` must be text naming the model (a hub id, a folder or a .gguf file), "
                        f"not {_shown(source)}; quote it if it is a name.")
    if isinstance(source, str) and not source.strip():
        raise UserError(f"recipe {path}: `source:` is empty; name the model (a hub id, a folder or a .gguf file) or "
                        "remove the key.")
