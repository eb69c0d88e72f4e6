"""`mha2mla generate MODEL --prompt ...`: decode from the latent cache with absorbed weights. The options and their
help are GenerateConfig's fields (mha2mla/cli/settings.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from mha2mla import UserError
from mha2mla.cli.settings import Flags, with_settings
from mha2mla.devices import check_device
from mha2mla.io.model_folder import check_model_folder
from mha2mla.modeling.generate_config import GenerateConfig

FLAGS = Flags(
    settings=("prompt", "max_new_tokens", "temperature", "top_p", "seed", "device", "compute_dtype", "chat", "ignore_eos"),
    names={"prompt": ("--prompt", "-p"), "max_new_tokens": ("--max-new-tokens", "-n")},
)


@with_settings("generate", GenerateConfig, FLAGS)
def generate(
    settings: GenerateConfig,
    model: Annotated[str, typer.Argument(help="A converted DeepSeek-V3 MLA folder (with absorbed.safetensors).")],
    recipe: Annotated[Path | None, typer.Option(help="A recipe YAML whose generate: section gives the settings; "
                                                     "options here win.")] = None,
) -> None:
    """Generate text from a converted model, decoding from the latent cache (streamed for a single prompt)."""
    check_device(settings.device)  # before the model loads: a device this machine has, or one sentence
    check_model_folder(model, hint="point at a folder written by `mha2mla convert`")
    from mha2mla.modeling.generate import MLAEngine

    engine = MLAEngine.from_pretrained(model, device=settings.device, compute_dtype=settings.compute_dtype)
    prompts: list = list(settings.prompt)
    if settings.chat:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise UserError("--chat needs a tokenizer with a chat template in the model folder.")
        prompts = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            for p in prompts
        ]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]

    def stream(row: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    single = len(prompts) == 1
    results = engine.generate(
        prompts,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=settings.seed,
        stream=stream if single else None,
        eos_token_ids=[] if settings.ignore_eos else None,
    )
    if single:
        sys.stdout.write("\n")
        return
    for index, result in enumerate(results):
        sys.stdout.write(f"[{index}] {result.text}\n")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
