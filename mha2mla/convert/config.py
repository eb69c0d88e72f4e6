"""``ConvertConfig``: everything a user decides about a conversion, the only home of the defaults. The Python API
builds it directly; ``mha2mla convert`` builds it from a recipe's ``convert:`` section and the flags given
(``mha2mla.recipes``), its options and help generated from these fields."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CALIB_NONE = ("none", "")
KV_BUDGET = 0.25  # the budget when neither kv_budget nor kv_lora_rank with rope_dim is given (docs/benchmarks.md)
CALIB_SAMPLES = 256  # calibration windows below WIDE_HIDDEN_SIZE
CALIB_SAMPLES_WIDE = 128  # past it, so that one layer's working set at 70B widths stays within a 24 GiB host
WIDE_HIDDEN_SIZE = 4096
CALIBRATION_KEYS = ("calib_samples", "calib_seq_len", "calib_device", "compute_dtype", "max_memory")


class ConvertConfig(BaseModel):
    """Unknown keys are rejected (typos in recipes fail loudly). The methods are not options: the plan picks the
    best method with calibration (docs/benchmarks.md), or the weight-only path with ``calib=None`` (``--calib none``)."""

    model_config = ConfigDict(extra="forbid")

    # a size given on the command line replaces the recipe's other way of giving it (mha2mla.recipes.merge)
    REPLACED_BY: ClassVar[dict[str, tuple[str, ...]]] = {
        "kv_budget": ("kv_lora_rank", "rope_dim"), "kv_lora_rank": ("kv_budget",), "rope_dim": ("kv_budget",)}

    profile: Literal["portable", "exact"] = Field(
        "portable", description="portable: what serving engines build (no attention biases, silu, interleaved plain "
        "rope; the target picks the shapes); exact: transformers only, exact at full capacity")
    target: Literal["transformers", "vllm", "sglang", "llama.cpp"] = Field(
        "transformers", description="the engine whose loader and fast kernels the shapes must suit (docs/engines.md)")
    kv_budget: float | None = Field(None, description=f"fraction of the source's KV values per token per layer to "
                                    f"keep ({KV_BUDGET} unless kv_lora_rank and rope_dim are given)")
    kv_lora_rank: int | None = Field(None, description="the config's kv_lora_rank (what the cache stores, extra "
                                     "latent channels included), with rope_dim instead of kv_budget")
    rope_dim: int | None = Field(None, description="qk_rope_head_dim: size of the shared rope key (with kv_lora_rank)")
    rope_stride: int | None = Field(None, description="keep every s-th source rope pair from the fastest (the plan's "
                                    "choice when not given, docs/calibration.md \"rope pairs\")")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="output dtype (auto: the source's)")
    calib: str | None = Field("default", description="calibration text: `default` (the bundled sample), a "
                              ".txt/.jsonl/.parquet file, a folder or a dataset id; `none` for the fast weight-only "
                              "path (poor quality without `mha2mla recover`)")
    calib_samples: int | None = Field(None, description=f"calibration windows ({CALIB_SAMPLES}, {CALIB_SAMPLES_WIDE} "
                                      f"past hidden size {WIDE_HIDDEN_SIZE}, when not given; fewer is faster and worse)")
    calib_seq_len: int = Field(256, description="tokens per calibration window")
    calib_device: str | None = Field(None, description="device for calibration (cpu, cuda, cuda:1; cuda when "
                                     "available if not given)")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the calibration's layer forwards and the reconstruction (auto: bfloat16 on a "
        "GPU and on CPUs with AMX or AVX-512 BF16, else float32; statistics and solves stay float32/float64; "
        "float32 is exact, docs/design.md \"compute dtype\")")
    reconstruct: bool = Field(True, description="fit each calibrated layer to the source layer by gradient descent "
                              "(docs/calibration.md); off is faster and worse")
    max_memory: float | None = Field(None, description="GiB one calibrated layer may use on the host; past it the "
                                     "calibration activations go to disk (the memory available at the start if not given)")
    max_shard_size: int = Field(2 * 1024**3, description="largest safetensors shard written, in bytes")
    untie_embeddings: bool | None = Field(None, description="write lm_head explicitly (yes for portable if not given)")

    @property
    def calibrated(self) -> bool:
        return self.calib is not None

    @property
    def budget(self) -> float:
        """The fraction the plan sizes the cache by: ``kv_budget``, or KV_BUDGET when it is not given."""
        return self.kv_budget if self.kv_budget is not None else KV_BUDGET

    def calib_samples_for(self, hidden_size: int) -> int:
        """Calibration windows for a source of ``hidden_size``: ``calib_samples``, or the default for that width."""
        if self.calib_samples is not None:
            return self.calib_samples
        return CALIB_SAMPLES if hidden_size <= WIDE_HIDDEN_SIZE else CALIB_SAMPLES_WIDE

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

    @model_validator(mode="after")
    def _weight_only_calibrates_nothing(self):
        if self.calib is not None:
            return self
        given = [key for key in CALIBRATION_KEYS  # set to something else than the default, which nothing reads here
                 if key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default]
        if self.reconstruct and "reconstruct" in self.model_fields_set:
            given.append("reconstruct")
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"calib none (--calib none, the weight-only path) calibrates nothing, so {given[0]} "
                             f"({flag}) contradicts it; drop one of them")
        return self
