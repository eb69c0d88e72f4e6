"""The ``eval:`` section of a recipe file: the settings ``mha2mla eval --recipe R.yaml`` starts from.

Every key mirrors an ``eval`` option (docs/eval.md); options given on the command line win over the recipe.
Paths are taken relative to the current folder, like the recipe's ``source``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mha2mla import UserError
from mha2mla.convert.options import load_recipe


class EvalSettings(BaseModel):
    """The keys an ``eval:`` section may hold; all optional, unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] | str | None = None
    baseline: str | None = None
    limit: float | None = Field(default=None, gt=0)
    text: str | None = None
    text_tokens: int | None = Field(default=None, ge=2)
    out: str | None = None
    device: str | None = None
    batch_size: int | None = Field(default=None, ge=1)
    seed: int | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None


def _explain(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(first["loc"][-1]), list(EvalSettings.model_fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"eval.{where} is not an eval setting{hint}"
    return f"eval.{where}: {first['msg']}"


def load_eval_settings(path: str | Path) -> EvalSettings:
    """The validated ``eval:`` section of the recipe at ``path`` (empty settings when it has none)."""
    recipe = load_recipe(path)
    section = recipe.eval or {}
    try:
        return EvalSettings.model_validate(section)
    except ValidationError as error:
        raise UserError(f"recipe {path} has an invalid eval section: {_explain(error)}; fix or remove that key.") from None


def merge_settings(recipe: EvalSettings | None, **flags) -> dict:
    """``run_eval`` keyword arguments: the recipe's values, then every command-line flag that was given (not None)."""
    merged = {key: value for key, value in (recipe.model_dump() if recipe else {}).items() if value is not None}
    merged.update({key: value for key, value in flags.items() if value is not None})
    return merged
