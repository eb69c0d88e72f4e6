"""``GenerateConfig``: the settings of one ``mha2mla generate`` run, the only home of their defaults (the CLI's
options and help come from these fields; a recipe's ``generate:`` section holds the same keys)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mha2mla.compute import MAX_SEED


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 for the tokenizer, or None. A command line's bytes that are not UTF-8
    reach Python as surrogate escapes (U+DC80..U+DCFF for byte 0x80..0xFF): those are named as the bytes they were."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        bad = text[error.start:error.end]
        if all(0xDC80 <= ord(char) <= 0xDCFF for char in bad):
            shown = " ".join(f"0x{ord(char) - 0xDC00:02x}" for char in bad)
            return f"holds bytes that are not UTF-8 ({shown} at character {error.start + 1}); give it as UTF-8 text"
        return f"holds a lone surrogate (U+{ord(bad[0]):04X} at character {error.start + 1}); give it as UTF-8 text"


class GenerateConfig(BaseModel):
    """What to generate from a converted model and how to sample it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: list[str] = Field(min_length=1, description="prompt text; repeat for a batch")
    max_new_tokens: int = Field(64, ge=1, description="tokens to generate per prompt")
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="nucleus sampling mass (with a temperature above 0)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description=f"seed for sampling (0 to {MAX_SEED})")
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

    @field_validator("prompt")
    @classmethod
    def _utf8(cls, prompts: list[str]) -> list[str]:
        """Every prompt must be text the tokenizer can take."""
        for index, prompt in enumerate(prompts):
            problem = utf8_problem(prompt)
            if problem is not None:
                which = "the prompt" if len(prompts) == 1 else f"prompt {index + 1}"
                raise ValueError(f"{which} {problem}")
        return prompts
