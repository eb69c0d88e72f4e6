"""`mha2mla generate MODEL --prompt ...`: decode from the latent cache with absorbed weights."""

from __future__ import annotations

import sys
from typing import Annotated, Literal

import typer

from mha2mla import UserError


def generate(
    model: Annotated[str, typer.Argument(help="A converted DeepSeek-V3 MLA folder (with absorbed.safetensors).")],
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for a batch.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --temperature > 0).")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda[:N].")] = "cpu",
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"] | None,
        typer.Option(help="Weights and cache dtype (default: float32 on CPU, bfloat16 on CUDA)."),
    ] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the tokenizer's chat template.")] = False,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Always generate --max-new-tokens tokens.")] = False,
) -> None:
    """Generate text from a converted model, decoding from the latent cache (streamed for a single prompt)."""
    import torch

    from mha2mla.modeling.generate import MLAEngine

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu.")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype {dtype} is not one of float32, bfloat16, float16.")
    engine = MLAEngine.from_pretrained(model, device=device, dtype=dtype)
    prompts: list = list(prompt)
    if chat:
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
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stream=stream if single else None,
        eos_token_ids=[] if ignore_eos else None,
    )
    if single:
        sys.stdout.write("\n")
        return
    for index, result in enumerate(results):
        sys.stdout.write(f"[{index}] {result.text}\n")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
