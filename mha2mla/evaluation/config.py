"""``EvalConfig``: the settings of one ``mha2mla eval`` run, the only home of their defaults (``run_eval`` takes
one, the CLI's options and help come from its fields, a recipe's ``eval:`` section holds the same keys)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mha2mla.compute import MAX_SEED

PROMPT_TOKENS = 512  # tokens of the bundled sample text used for the KV-cache and throughput measurements


class EvalConfig(BaseModel):
    """Which models to evaluate against which baseline, on what, and how. Paths are taken relative to the
    current folder, like a recipe's ``source``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[str] = Field(["default"], min_length=1, description="model folders or .gguf files to evaluate "
                              "(`default`: the SmolLM2-135M-Instruct GGUF that make assets caches)")
    baseline: str | None = Field(None, description="source model to compare against (folder, .gguf, or `default`)")
    tasks: list[str] | None = Field(None, description="tasks for lm-eval, comma-separated or repeated (the bundled "
                                    "tasks available here when not given, or none beside --text)")
    limit: float | None = Field(None, gt=0, description="documents per task (a value below 1 is a fraction)")
    out: str = Field("eval", description="folder for results.json, results.md and the plots")
    device: str | None = Field(None, description="device: cpu, cuda, cuda:1, ... (cuda when available if not "
                                   "given)")
    batch_size: int = Field(1, ge=1, description="batch size of lm-eval")
    seed: int = Field(1234, ge=0, le=MAX_SEED, description="seed for every random source of lm-eval, the same for "
                      f"the baseline (0 to {MAX_SEED})")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights dtype (auto: the checkpoint's own; bfloat16 for a .gguf, the dtype its conversion writes)")
    text: str | None = Field(None, description="a UTF-8 text file to score for token perplexity (offline); alone, "
                             "it replaces the default tasks")
    text_tokens: int = Field(16384, ge=2, description="tokens read from the start of --text")
    prompt_tokens: int = Field(PROMPT_TOKENS, ge=1, description="tokens of the bundled sample text for the KV-cache "
                               "and throughput measurements")

    @field_validator("models", "tasks", mode="before")
    @classmethod
    def _one_name(cls, value):
        """One name given as a plain string (``tasks: kjv_ppl,arc_easy`` in a recipe) is a list of one."""
        return [value] if isinstance(value, str) else value
