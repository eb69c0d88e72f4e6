"""``mha2mla recover``: parse options, build a RecoverConfig, call mha2mla.train.recover."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

from mha2mla import UserError


def register(app: typer.Typer) -> None:
    app.command(name="recover")(recover_command)


def recover_command(
    model: Path = typer.Argument(..., help="Converted DeepSeek-V3 MLA folder (output of `mha2mla convert`)."),
    data: list[str] = typer.Option(..., "--data", help="Text: .txt/.jsonl/.parquet file, a folder of them, or a HF dataset id (name[@split]). Repeatable."),
    out: Path = typer.Option(..., "--out", help="Output folder: checkpoints during the run, the recovered model at the end."),
    teacher: str | None = typer.Option(None, "--teacher", help="Source model (HF folder or .gguf) to distil from."),
    eval_data: list[str] | None = typer.Option(None, "--eval-data", help="Held-out text for perplexity (default: rows held out of --data)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Training tokens (over all processes)."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Optimizer steps (overrides --max-tokens)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Packed sequence length."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per micro-batch per process."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    learning_rate: float = typer.Option(2e-4, "--lr", help="Peak learning rate."),
    weight_decay: float = typer.Option(0.0, "--weight-decay"),
    warmup_steps: int = typer.Option(0, "--warmup-steps"),
    schedule: str = typer.Option("cosine", "--schedule", help="cosine | linear | constant (after warmup)."),
    min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help="Final learning rate as a fraction of the peak."),
    full_attention: bool = typer.Option(False, "--full-attention", help="Train every attention parameter in full instead of LoRA."),
    lora_rank: int = typer.Option(16, "--lora-rank"),
    lora_alpha: float = typer.Option(32.0, "--lora-alpha"),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout"),
    lora_targets: str = typer.Option("q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj", "--lora-targets", help="Comma-separated module names."),
    train_norms: bool = typer.Option(True, "--train-norms/--no-train-norms", help="Train kv_a_layernorm alongside LoRA."),
    distill_weight: float = typer.Option(0.5, "--distill-weight", help="Weight of the KL term (the LM loss gets 1 - weight)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Distillation temperature."),
    eval_sequences: int = typer.Option(8, "--eval-sequences", help="Packed sequences used for held-out perplexity."),
    eval_every: int = typer.Option(50, "--eval-every", help="Steps between perplexity evaluations (0: start and end only)."),
    save_every: int = typer.Option(50, "--save-every", help="Steps between checkpoints (0: none)."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints"),
    resume: str | None = typer.Option(None, "--resume", help="auto (latest checkpoint in OUT) or a checkpoint folder."),
    attn_implementation: str = typer.Option("sdpa", "--attn-implementation", help="sdpa | eager | mha2mla_triton."),
    mixed_precision: str = typer.Option("auto", "--mixed-precision", help="auto (bf16 on GPU) | no | bf16."),
    text_field: str = typer.Option("text", "--text-field", help="Field holding the text in .jsonl/.parquet/datasets."),
    seed: int = typer.Option(0, "--seed"),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Heal a converted MLA model: LoRA (or full attention) fine-tuning, optional distillation from the
    source, resumable checkpoints, and the merged native DeepSeek-V3 checkpoint written to OUT."""
    from pydantic import ValidationError

    from mha2mla.train import RecoverConfig, recover

    try:
        config = RecoverConfig(
            model=str(model), data=list(data), out=str(out), teacher=teacher, eval_data=list(eval_data) if eval_data else None,
            max_tokens=max_tokens, max_steps=max_steps, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
            learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps, schedule=schedule,
            min_lr_ratio=min_lr_ratio, full_attention=full_attention, lora_rank=lora_rank, lora_alpha=lora_alpha,
            lora_dropout=lora_dropout, lora_targets=tuple(t.strip() for t in lora_targets.split(",") if t.strip()),
            train_norms=train_norms, distill_weight=distill_weight, temperature=temperature,
            eval_sequences=eval_sequences, eval_every=eval_every, save_every=save_every,
            keep_checkpoints=keep_checkpoints, attn_implementation=attn_implementation,
            mixed_precision=mixed_precision, text_field=text_field, seed=seed,
        )
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "options"
        raise UserError(f"invalid {where.replace('_', '-')}: {first['msg']}.") from None
    quiet = logging.getLogger().level > logging.INFO
    report = recover(config, resume=resume, show_progress=not (no_progress or quiet))
    if os.environ.get("RANK", "0") != "0":  # under accelerate launch / torchrun only the main process reports
        return
    summary = {key: report[key] for key in ("steps", "tokens_trained", "final_loss", "tokens_per_second")}
    if report["evaluations"]:
        summary["perplexity_before"] = report["evaluations"][0]["perplexity"]
        summary["perplexity_after"] = report["evaluations"][-1]["perplexity"]
    typer.echo(json.dumps(summary))
    typer.echo(f"recovered model written to {out}")
