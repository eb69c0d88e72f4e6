"""``GenerateConfig``: the settings of one ``mha2mla generate`` run, the only home of their defaults (the CLI's
options and help come from these fields; a recipe's ``generate:`` section holds the same keys)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GenerateConfig(BaseModel):
    """What to generate from a converted model and how to sample it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: list[str] = Field(min_length=1, description="prompt text; repeat for a batch")
    max_new_tokens: int = Field(64, ge=1, description="tokens to generate per prompt")
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="nucleus sampling mass (with a temperature above 0)")
    seed: int | None = Field(None, description="seed for sampling")
    device: str = Field("cpu", description="device: cpu or cuda[:N]")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights, activations and latent-cache dtype of the decode: auto is bfloat16 on a GPU or "
                            "CPU that multiplies bf16 natively, float32 elsewhere; logits are float32 either way")
    chat: bool = Field(False, description="wrap each prompt in the tokenizer's chat template")
    ignore_eos: bool = Field(False, description="always generate max_new_tokens tokens")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        """One prompt given as a plain string (``prompt: hello`` in a recipe) is a batch of one."""
        return [value] if isinstance(value, str) else value
