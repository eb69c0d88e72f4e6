"""Settings of one recovery run, validated once (pydantic, unknown keys rejected) and saved beside the output.

``RecoverConfig`` is the single source of the settings and their defaults: the Python API builds it directly,
``mha2mla recover`` builds it from a recipe's ``recover:`` section plus the flags given (mha2mla.recipes,
docs/recover.md), its options and help generated from these fields (mha2mla/cli/settings.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mha2mla.compute import MAX_SEED

MLA_LORA_TARGETS = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
SOURCE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the same budget on an MHA/GQA model
TRAINABLE_NORMS = ("kv_a_layernorm",)


DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$")
UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600}


def duration_seconds(text: str) -> float:
    """A duration as a number of seconds: a bare number, or a number followed by the unit letter s, m or h (seconds,
    minutes, hours); anything else is a ValueError naming the forms."""
    match = DURATION.match(str(text))
    if not match or float(match[1]) <= 0:
        raise ValueError(f"{text!r} is not a duration; give a positive number of seconds, or one ending in s, m or h "
                         "(e.g. 80m, 1.5h)")
    return float(match[1]) * UNIT_SECONDS[match[2]]


class LoraSettings(BaseModel):
    """The peft LoRA adapter ``make_trainable`` puts on a model (a recipe's ``recover: lora:`` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(16, ge=1, description="LoRA rank")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (the adapter's update is scaled by alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: tuple[str, ...] = Field(MLA_LORA_TARGETS, min_length=1, description="module names that get an adapter")
    train_norms: bool = Field(True, description="also train kv_a_layernorm in full (peft modules_to_save)")

    @field_validator("targets", mode="before")
    @classmethod
    def _split_names(cls, value):
        """``"q_proj,o_proj"`` (the CLI's and a recipe's short form) is the tuple of those names."""
        if isinstance(value, str):
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return value


class RecoverConfig(BaseModel):
    """Everything that decides what a recovery run computes. Paths are plain strings so the config
    round-trips through JSON (``OUT/recover_config.json``), which ``--resume`` compares against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="converted DeepSeek-V3 MLA folder (output of `mha2mla convert`)")
    data: list[str] | None = Field(None, description="training text: .txt/.jsonl/.parquet file, a folder of them, or a "
                                   "Hugging Face dataset id (name or name@split); none: the default healing text (default_data)")
    out: str = Field(description="output folder: checkpoints (OUT/checkpoints) during the run, the recovered model at "
                     "the end")
    teacher: str | None = Field(None, description="source model (HF folder, .gguf or hub id) to distil from")
    eval_data: list[str] | None = Field(None, description="held-out text for perplexity (default: rows held out of the data)")

    # data
    seq_len: int = Field(512, ge=8, description="packed sequence length in tokens")
    text_field: str = Field("text", description="field holding the text in .jsonl/.parquet files and datasets")
    eval_sequences: int = Field(8, ge=0, description="packed sequences used for held-out perplexity (0: no evaluation)")
    default_data: Literal["general", "generated"] = Field(
        "general", description="training text when there is no --data: general (real text of several domains, "
        "built by `make assets`) or generated (text the --teacher writes); docs/recover.md, \"No dataset\"")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the LoRA initialisation, of the row order and of "
                      f"generated text (0 to {MAX_SEED})")
    generated_temperature: float = Field(1.0, gt=0, description="sampling temperature of the text the teacher "
                                         "generates when there is no --data")
    generated_top_p: float | None = Field(None, gt=0, le=1, description="top-p (nucleus) sampling of the text the "
                                          "teacher generates when there is no --data (none: the whole distribution)")

    # what trains
    full_attention: bool = Field(False, description="train every attention parameter in full instead of LoRA")
    full_layers: bool = Field(False, description="train every decoder-layer parameter in full (attention, MLP, norms; "
                              "the embeddings and lm_head stay frozen) instead of LoRA")
    lora: LoraSettings = Field(LoraSettings(), description="the LoRA adapter (unused with full_attention or full_layers)")

    # optimisation
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    learning_rate: float = Field(2e-4, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping norm (None: no clipping)")
    warmup_steps: int = Field(0, ge=0, description="steps of linear learning-rate warmup")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warmup")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of the peak")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (wins over the token count)")
    max_tokens: int | None = Field(None, ge=1, description="training tokens over all processes")
    max_time: str | None = Field(None, description="stop training before this much wall time has passed (90s, 80m, "
                                 "1.5h; summed over resumptions), then evaluate and write the model as at the end; the "
                                 "schedule still spans max_steps / max_tokens")

    # distillation
    distill_weight: float = Field(0.5, ge=0, le=1, description="weight of the KL term; 1 - weight goes to the LM loss")
    temperature: float = Field(1.0, gt=0, description="distillation temperature")

    # runtime
    attn_implementation: Literal["sdpa", "eager", "mha2mla_triton", "auto"] = Field(
        "sdpa", description="attention kernel; auto: the Triton MLA kernel where a GPU measurement shows it at least as "
        "fast as SDPA for this GPU, compute dtype and head dims, SDPA elsewhere (docs/kernels.md)")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="what the forwards and backwards compute in: bfloat16 (autocast over float32 trainable and "
        "frozen weights, the teacher in bfloat16) or float32 throughout; auto: bfloat16 on a GPU, and on a CPU that "
        "multiplies bf16 natively when the parameters train in full; float32 with LoRA on a CPU, where bf16 made "
        "the model worse (docs/benchmarks.md, \"Compute dtype in recovery\")")
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = Field(
        "auto", description="recompute activations in the backward pass instead of keeping them: selective keeps only "
        "the matrix products' and attention's outputs (recomputes norms, casts, rotary, activations), full keeps only "
        "each decoder layer's input (about one more forward per step); the same gradients; auto: full when every "
        "decoder layer trains (full_layers), else none, or the least that makes the memory estimate fit the device "
        "(docs/recover.md, \"Memory\")")
    eval_every: int = Field(50, ge=0, description="steps between held-out perplexity evaluations (0: start and end only)")
    save_every: int = Field(50, ge=0, description="steps between checkpoints (0: none)")
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept in OUT/checkpoints while the run trains")
    keep_checkpoints_after_run: bool = Field(False, description="leave OUT/checkpoints in place once the model is "
                                             "written (no: removed then, so the finished OUT is the model)")

    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _one_source(cls, value):
        """One source given as a plain string (``data: corpus.txt`` in a recipe) is a list of one; an empty list is
        none."""
        return [value] if isinstance(value, str) else (value or None)

    @field_validator("max_time")
    @classmethod
    def _duration(cls, value):
        if value is not None:
            duration_seconds(value)  # a ValueError naming the accepted forms
        return value

    @model_validator(mode="after")
    def _check(self) -> RecoverConfig:
        if self.max_steps is None and self.max_tokens is None:
            raise ValueError("give --max-steps or --max-tokens (max_steps or max_tokens in a recipe)")
        if not self.data and self.default_data == "generated" and self.teacher is None:
            raise ValueError("give --teacher to train on the text it generates (default_data generated), or --data")
        return self

    @property
    def adapter(self) -> LoraSettings | None:
        """The LoRA adapter to train, or None when parameters train in full (full_attention, full_layers)."""
        return None if self.full_attention or self.full_layers else self.lora

    @property
    def max_time_seconds(self) -> float | None:
        return None if self.max_time is None else duration_seconds(self.max_time)

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
        skip = {"out", "eval_every", "save_every", "keep_checkpoints", "keep_checkpoints_after_run",
                "activation_checkpointing",  # exact: the same gradients
                "max_time"}  # a resumed run may be given more time
        return {key: value for key, value in self.model_dump(mode="json").items() if key not in skip}

    @property
    def out_path(self) -> Path:
        return Path(self.out).expanduser()

