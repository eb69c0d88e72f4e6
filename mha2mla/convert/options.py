"""Conversion options: one pydantic model shared by the Python API, the CLI and recipe files."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mha2mla import UserError

CALIB_NONE = ("none", "")


class ConvertOptions(BaseModel):
    """Everything a user decides about a conversion. Unknown keys are rejected (typos in recipes fail
    loudly). The methods are not options: the plan picks the measured best (docs/benchmarks.md) with
    calibration, or the weight-only path with ``calib=None`` (``--calib none``)."""

    model_config = ConfigDict(extra="forbid")

    profile: Literal["portable", "exact"] = "portable"
    target: Literal["transformers", "vllm", "sglang", "llama.cpp"] = Field(
        "transformers", description="the engine whose loader and fast kernels the shapes must suit (docs/engines.md)")
    kv_budget: float | None = Field(None, description="fraction of the source's KV values per token per layer")
    kv_lora_rank: int | None = Field(None, description="the config's kv_lora_rank (extra latent channels included)")
    rope_dim: int | None = Field(None, description="qk_rope_head_dim, the shared rope key's size")
    rope_stride: int | None = Field(None, description="keep every s-th source rope pair from the fastest (default: the "
                                    "plan's measured choice, docs/calibration.md \"rope pairs\")")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    calib: str | None = Field("default", description="calibration text: `default` (bundled sample), a file, folder or "
                              "dataset id; None or `none` for the fast weight-only path (poor without recovery)")
    calib_samples: int | None = Field(None, description="calibration windows (default: 256; 128 past hidden size "
                                     "4096, so that one layer's working set at 70B widths stays under 24 GiB)")
    calib_seq_len: int = 256
    calib_device: str | None = Field(None, description="device for calibration forwards (default: cuda if available)")
    reconstruct: bool = Field(True, description="fit each calibrated layer to the source layer by gradient descent "
                              "(docs/calibration.md, reconstruction); False is faster and worse")
    max_memory: float | None = Field(None, description="GiB one calibrated layer may use on the host; past it the "
                                     "calibration activations go to disk (default: the memory available at the start)")
    max_shard_size: int = 2 * 1024**3
    untie_embeddings: bool | None = Field(None, description="write lm_head explicitly (default: yes for portable)")

    @property
    def calibrated(self) -> bool:
        return self.calib is not None

    @field_validator("calib")
    @classmethod
    def _calib_none(cls, value):
        return None if value is None or value.strip().lower() in CALIB_NONE else value

    @field_validator("kv_budget")
    @classmethod
    def _budget_range(cls, value):
        if value is not None and not 0 < value <= 1:
            raise ValueError("must be a fraction in (0, 1]")
        return value

    @field_validator("kv_lora_rank", "rope_dim", "rope_stride", "calib_samples", "calib_seq_len", "max_memory")
    @classmethod
    def _positive(cls, value):
        if value is not None and value <= 0:
            raise ValueError("must be positive")
        return value

    @model_validator(mode="after")
    def _one_size(self):
        explicit = self.kv_lora_rank is not None or self.rope_dim is not None
        if explicit and self.kv_budget is not None:
            raise ValueError("give either kv_budget (--kv-budget) or kv_lora_rank with rope_dim (--kv-lora-rank, --rope-dim), not both")
        if explicit and (self.kv_lora_rank is None or self.rope_dim is None):
            raise ValueError("kv_lora_rank (--kv-lora-rank) and rope_dim (--rope-dim) go together; give both, or kv_budget")
        return self


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
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


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
    given = {key: value for key, value in overrides.items() if value is not None}
    if given.keys() & {"kv_lora_rank", "rope_dim"}:  # sizes given on the command line replace the recipe's
        data.pop("kv_budget", None)
    if "kv_budget" in given:
        data.pop("kv_lora_rank", None)
        data.pop("rope_dim", None)
    data.update(given)
    try:
        return ConvertOptions.model_validate(data)
    except ValidationError as error:
        raise UserError(f"invalid option ({_explain(error)}).") from error
