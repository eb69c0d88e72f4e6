"""Conversion options: one pydantic model shared by the Python API, the CLI and recipe files."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mha2mla import UserError

# the measured best methods (benchmarks/quality.py, docs/benchmarks.md), with and without calibration
AUTO_METHODS = {
    "calibrated": {"rope_mixing": "activation", "lowrank": "attention", "rope_compensation": "mean",
                   "norm_calibration": "stabilized", "refit": "output"},
    "weight_only": {"rope_mixing": "weight", "lowrank": "svd", "rope_compensation": "none", "norm_calibration": "rms",
                    "refit": "none"},
}


class ConvertOptions(BaseModel):
    """Everything that decides a conversion. Unknown keys are rejected (typos in recipes fail loudly)."""

    model_config = ConfigDict(extra="forbid")

    profile: Literal["portable", "exact"] = "portable"
    kv_budget: float | None = Field(None, description="fraction of the source's KV values per token per layer")
    kv_lora_rank: int | None = Field(None, description="the config's kv_lora_rank (exact profile: constant channel included)")
    rope_dim: int | None = Field(None, description="qk_rope_head_dim, the shared rope key's size")
    rope_frequencies: Literal["high", "stride"] = "high"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    balance_kv: bool = True
    # calibration-aware initialisation (statistics of the attention inputs)
    calib: str | None = Field(None, description="calibration text: file, folder, dataset id, or `default` (bundled sample)")
    calib_samples: int = 128
    calib_seq_len: int = 256
    calib_sequential: bool = Field(True, description="calibrate layer i on the outputs of the converted layers before it "
                                   "(measured better with the attention-aware default, docs/benchmarks.md)")
    calib_device: str | None = Field(None, description="device for calibration forwards (default: cuda if available)")
    # methods (docs/calibration.md); `auto` = the measured best with calibration, weight-only without
    rope_mixing: Literal["auto", "weight", "activation", "query"] = "auto"
    lowrank: Literal["auto", "svd", "pca", "whiten", "score", "attention"] = "auto"
    rope_compensation: Literal["auto", "none", "mean"] = Field("auto", description="what stands in for a dropped rotation: "
                                                              "nothing, or its attention-weighted mean (calibrated)")
    norm_calibration: Literal["auto", "rms", "mean", "channel", "stabilized"] = "auto"
    refit: Literal["auto", "none", "values", "output"] = Field(
        "auto", description="refit each head's V up-projection (values), then o_proj too (output), on what the converted "
        "layer computes, towards the source model's outputs (calibrated)")
    max_shard_size: int = 2 * 1024**3
    untie_embeddings: bool | None = Field(None, description="write lm_head explicitly (default: yes for portable)")

    def resolved_methods(self, calibrated: bool) -> dict[str, str]:
        """The methods actually used: ``auto`` picks the measured defaults (docs/benchmarks.md)."""
        auto = AUTO_METHODS["calibrated" if calibrated else "weight_only"]
        return {key: auto[key] if getattr(self, key) == "auto" else getattr(self, key) for key in auto}

    @field_validator("kv_budget")
    @classmethod
    def _budget_range(cls, value):
        if value is not None and not 0 < value <= 1:
            raise ValueError("must be a fraction in (0, 1]")
        return value

    @field_validator("kv_lora_rank", "rope_dim", "calib_samples", "calib_seq_len")
    @classmethod
    def _positive(cls, value):
        if value is not None and value <= 0:
            raise ValueError("must be positive")
        return value


class Recipe(BaseModel):
    """A recipe file: the exact command in a comment at the top, then these keys."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = None
    convert: ConvertOptions = ConvertOptions()
    recover: dict | None = None
    eval: dict | None = None


def _explain(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}"


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.exists():
        raise UserError(f"recipe {path} does not exist.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
        return Recipe.model_validate(data)
    except yaml.YAMLError as error:
        raise UserError(f"recipe {path} is not valid YAML ({error}).") from error
    except ValidationError as error:
        raise UserError(f"recipe {path} is invalid ({_explain(error)}); fix or remove that key.") from error


def build_options(recipe: Recipe | None = None, **overrides) -> ConvertOptions:
    """Recipe values, then every override that is not None."""
    data = recipe.convert.model_dump(exclude_unset=True) if recipe else {}
    data.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return ConvertOptions.model_validate(data)
    except ValidationError as error:
        raise UserError(f"invalid option ({_explain(error)}).") from error
