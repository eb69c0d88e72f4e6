"""Settings of one recovery run, validated once (pydantic, unknown keys rejected) and saved beside the output."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MLA_LORA_TARGETS = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
SOURCE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the same budget on an MHA/GQA model
TRAINABLE_NORMS = ("kv_a_layernorm",)


class RecoverConfig(BaseModel):
    """Everything that decides what a recovery run computes. Paths are plain strings so the config
    round-trips through JSON (``OUT/recover_config.json``), which ``--resume`` compares against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="converted DeepSeek-V3 MLA folder")
    data: list[str] = Field(description="text files, folders of them, or one Hugging Face dataset id")
    out: str
    teacher: str | None = Field(None, description="source model (HF folder or .gguf) for distillation")
    eval_data: list[str] | None = None

    # data
    seq_len: int = Field(512, ge=8)
    text_field: str = "text"
    eval_sequences: int = Field(8, ge=0, description="packed sequences held out of the training data")
    seed: int = 0

    # what trains
    full_attention: bool = False
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: tuple[str, ...] = MLA_LORA_TARGETS
    train_norms: bool = True

    # optimisation
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(1, ge=1)
    learning_rate: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = 1.0
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_steps: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)

    # distillation
    distill_weight: float = Field(0.5, ge=0, le=1, description="weight of the KL term; 1 - weight goes to the LM loss")
    temperature: float = Field(1.0, gt=0)

    # runtime
    attn_implementation: Literal["sdpa", "eager", "mha2mla_triton"] = "sdpa"
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    eval_every: int = Field(50, ge=0, description="steps between held-out perplexity evaluations (0: only at the end)")
    save_every: int = Field(50, ge=0, description="steps between checkpoints (0: none)")
    keep_checkpoints: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _check(self) -> RecoverConfig:
        if self.max_steps is None and self.max_tokens is None:
            raise ValueError("give --max-steps or --max-tokens")
        if not self.data:
            raise ValueError("give at least one --data source")
        return self

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimizer step for one process (multiply by the number of processes)."""
        return self.batch_size * self.grad_accum * self.seq_len

    def total_steps(self, num_processes: int = 1) -> int:
        if self.max_steps is not None:
            return self.max_steps
        per_step = self.tokens_per_step * num_processes
        return max(1, -(-self.max_tokens // per_step))

    def outcome_fields(self) -> dict:
        """Fields that must match between a run and its resumption (everything but runtime conveniences)."""
        skip = {"out", "eval_every", "save_every", "keep_checkpoints"}
        return {key: value for key, value in self.model_dump(mode="json").items() if key not in skip}

    @property
    def out_path(self) -> Path:
        return Path(self.out)
