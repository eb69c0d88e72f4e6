"""``mha2mla recover``: a recipe's ``recover:`` section, then the flags given over it, validated as one
RecoverConfig (mha2mla.recipes), then mha2mla.train.recover. The options and their help are RecoverConfig's
fields (mha2mla/cli/settings.py; docs/recover.md)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import typer

from mha2mla.cli.settings import Flags, with_settings
from mha2mla.extras import require_extra
from mha2mla.train.config import RecoverConfig

FLAGS = Flags(
    settings=("data", "out", "teacher", "eval_data", "max_tokens", "max_steps", "max_time", "seq_len", "batch_size", "grad_accum",
              "learning_rate", "weight_decay", "warmup_steps", "schedule", "min_lr_ratio", "full_attention", "full_layers",
              "lora.rank", "lora.alpha", "lora.dropout", "lora.targets", "lora.train_norms", "distill_weight",
              "temperature", "eval_sequences", "eval_every", "save_every", "keep_checkpoints",
              "keep_checkpoints_after_run",
              "attn_implementation", "compute_dtype", "activation_checkpointing", "text_field", "seed",
              "default_data", "generated_temperature", "generated_top_p"),
    arguments=("model",),
    names={"learning_rate": ("--lr",), "lora.train_norms": ("--train-norms",)},
)


@with_settings("recover", RecoverConfig, FLAGS)
def recover_command(
    settings: RecoverConfig,
    model: Path = typer.Argument(..., help="Converted DeepSeek-V3 MLA folder (output of `mha2mla convert`)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Recipe YAML whose `recover:` section gives the "
                                          "settings (its keys are the setting names below, LoRA ones under `lora:`); "
                                          "flags given win over it."),
    resume: Optional[str] = typer.Option(None, "--resume", help="auto (latest checkpoint in OUT) or a checkpoint folder."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    dry_run: bool = typer.Option(False, "--dry-run", help="State the run's memory per process (weights, gradients, "
                                 "optimizer, teacher, activations, logits, data) and whether it fits the device, then "
                                 "stop: nothing loads, nothing is written."),
) -> None:
    """Heal a converted MLA model: LoRA (or full attention, or every layer) fine-tuning, optional distillation from the
    source, resumable checkpoints, and the merged native DeepSeek-V3 checkpoint written to OUT."""
    require_extra("recover", "`mha2mla recover`")
    if dry_run:
        from mha2mla.train.memory import check_fits, planned

        sized, device, compute_dtype = planned(settings)
        typer.echo(f"memory per process, estimated ({device}, {compute_dtype}):")
        typer.echo("\n".join(sized.memory.lines()))
        typer.echo(sized.checkpointing_line)
        check_fits(sized.memory, device)
        typer.echo(f"fits: {device} has enough free memory for this estimate.")
        return
    from mha2mla.train.trainer import recover  # torch, accelerate, peft: only once a run starts

    quiet = logging.getLogger().level > logging.INFO
    report = recover(settings, resume=resume, show_progress=not (no_progress or quiet))
    if os.environ.get("RANK", "0") != "0":  # under accelerate launch / torchrun only the main process reports
        return
    summary = {key: report[key] for key in ("steps", "tokens_trained", "final_loss", "tokens_per_second")}
    if report["evaluations"]:
        summary["perplexity_before"] = report["evaluations"][0]["perplexity"]
        summary["perplexity_after"] = report["evaluations"][-1]["perplexity"]
    typer.echo(json.dumps(summary))
    typer.echo(f"recovered model written to {settings.out}")


def register(app: typer.Typer) -> None:
    app.command(name="recover")(recover_command)
