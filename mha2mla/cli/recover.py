"""``mha2mla recover``: a recipe's ``recover:`` section, then the flags given over it, validated as one
RecoverConfig, then mha2mla.train.recover.

Every setting's flag defaults to None: a flag not given leaves the setting to the recipe, or else to
RecoverConfig's default, which is the only copy of the defaults (the help shows it). The help texts are the
settings' descriptions in mha2mla/train/config.py (docs/recover.md)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal, Optional, get_args, get_origin

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from mha2mla import UserError
from mha2mla.convert.options import load_recipe
from mha2mla.extras import require_extra
from mha2mla.train.config import LoraSettings, RecoverConfig, merge_settings

# settings whose flag is not ``--`` + the name with dashes
FLAG_NAMES = {"learning_rate": "--lr", "lora.train_norms": "--train-norms", "lora.rank": "--lora-rank",
              "lora.alpha": "--lora-alpha", "lora.dropout": "--lora-dropout", "lora.targets": "--lora-targets",
              "model": "MODEL"}


def _field(key: str) -> FieldInfo:
    section, _, name = key.rpartition(".")
    return (LoraSettings if section == "lora" else RecoverConfig).model_fields[name]


def _help(key: str, before: str = "", after: str = "") -> str:
    """The setting's description as a help sentence (``before`` + description + ``after``), with its choices and
    RecoverConfig's default."""
    field = _field(key)
    text = before + field.description + after
    text = text[0].upper() + text[1:]
    if get_origin(field.annotation) is Literal:
        text += f": {' | '.join(get_args(field.annotation))}"
    default = field.default
    if field.is_required() or default is None:
        return text + "."
    if isinstance(default, tuple):
        default = ",".join(default)
    elif isinstance(default, bool):
        default = "yes" if default else "no"
    return f"{text}; default {default}."


def _flag(key: str) -> str:
    return FLAG_NAMES.get(key, "--" + key.replace("_", "-"))


def _nested(flat: dict) -> dict:
    """``{"lora.rank": 8, "seq_len": None}`` -> ``{"lora": {"rank": 8}}`` (flags not given are dropped)."""
    nested: dict = {}
    for key, value in flat.items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        (nested.setdefault(section, {}) if section else nested)[name] = value
    return nested


def _sentence(error: ValidationError, given: set[str], recipe: Path | None) -> str:
    """The first validation error as one sentence naming the flag, or the recipe key, that caused it."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"] if isinstance(part, str))
    origin = f"`{key}` under `recover:` in {recipe}" if recipe is not None and key not in given else _flag(key)
    if first["type"] == "extra_forbidden":
        return f"recipe {recipe} has an unknown recover setting {key!r}; fix or remove it (docs/recover.md lists them)."
    if first["type"] == "missing":
        return f"give {_flag(key)} (or `{key}:` under `recover:` in a --recipe)."
    if first["type"] == "literal_error":
        return f"{origin} must be one of {first['ctx']['expected']}, not {first['input']!r}."
    message = first["msg"].removeprefix("Value error, ")
    if not key:
        return message + "."
    return f"invalid {origin}: {message[0].lower()}{message[1:]}."


def build_config(recipe_path: Path | None, flags: dict) -> RecoverConfig:
    """The recipe's ``recover:`` section with the flags given (``flags``: setting -> value or None) over it."""
    section = {}
    if recipe_path is not None:
        section = load_recipe(recipe_path).recover or {}
    given = {key for key, value in flags.items() if value is not None}
    try:
        return RecoverConfig.model_validate(merge_settings(section, _nested(flags)))
    except ValidationError as error:
        raise UserError(_sentence(error, given, recipe_path)) from None


def register(app: typer.Typer) -> None:
    app.command(name="recover")(recover_command)


def recover_command(
    model: Path = typer.Argument(..., help="Converted DeepSeek-V3 MLA folder (output of `mha2mla convert`)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Recipe YAML whose `recover:` section gives the "
                                          "settings (its keys are the setting names below, LoRA ones under `lora:`); "
                                          "flags given win over it."),
    data: Optional[list[str]] = typer.Option(None, "--data", help=_help("data", after=" (repeatable)")),
    out: Optional[Path] = typer.Option(None, "--out", help=_help("out")),
    teacher: Optional[str] = typer.Option(None, "--teacher", help=_help("teacher")),
    eval_data: Optional[list[str]] = typer.Option(None, "--eval-data", help=_help("eval_data", after=" (repeatable)")),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help=_help("max_tokens")),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help=_help("max_steps")),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help=_help("seq_len")),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help=_help("batch_size")),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help=_help("grad_accum")),
    learning_rate: Optional[float] = typer.Option(None, "--lr", help=_help("learning_rate")),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help=_help("weight_decay")),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help=_help("warmup_steps")),
    schedule: Optional[str] = typer.Option(None, "--schedule", help=_help("schedule")),
    min_lr_ratio: Optional[float] = typer.Option(None, "--min-lr-ratio", help=_help("min_lr_ratio")),
    full_attention: Optional[bool] = typer.Option(None, "--full-attention/--no-full-attention", help=_help("full_attention")),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help=_help("lora.rank")),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help=_help("lora.alpha")),
    lora_dropout: Optional[float] = typer.Option(None, "--lora-dropout", help=_help("lora.dropout")),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help=_help("lora.targets", before="comma-separated ")),
    train_norms: Optional[bool] = typer.Option(None, "--train-norms/--no-train-norms", help=_help("lora.train_norms")),
    distill_weight: Optional[float] = typer.Option(None, "--distill-weight", help=_help("distill_weight")),
    temperature: Optional[float] = typer.Option(None, "--temperature", help=_help("temperature")),
    eval_sequences: Optional[int] = typer.Option(None, "--eval-sequences", help=_help("eval_sequences")),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help=_help("eval_every")),
    save_every: Optional[int] = typer.Option(None, "--save-every", help=_help("save_every")),
    keep_checkpoints: Optional[int] = typer.Option(None, "--keep-checkpoints", help=_help("keep_checkpoints")),
    attn_implementation: Optional[str] = typer.Option(None, "--attn-implementation", help=_help("attn_implementation")),
    mixed_precision: Optional[str] = typer.Option(None, "--mixed-precision", help=_help("mixed_precision")),
    text_field: Optional[str] = typer.Option(None, "--text-field", help=_help("text_field")),
    seed: Optional[int] = typer.Option(None, "--seed", help=_help("seed")),
    resume: Optional[str] = typer.Option(None, "--resume", help="auto (latest checkpoint in OUT) or a checkpoint folder."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Heal a converted MLA model: LoRA (or full attention) fine-tuning, optional distillation from the
    source, resumable checkpoints, and the merged native DeepSeek-V3 checkpoint written to OUT."""
    require_extra("recover", "`mha2mla recover`")
    from mha2mla.train.trainer import recover  # torch, accelerate, peft: only once a run starts

    flags = {
        "model": str(model), "data": data or None, "out": None if out is None else str(out), "teacher": teacher,
        "eval_data": eval_data or None, "max_tokens": max_tokens, "max_steps": max_steps, "seq_len": seq_len,
        "batch_size": batch_size, "grad_accum": grad_accum, "learning_rate": learning_rate, "weight_decay": weight_decay,
        "warmup_steps": warmup_steps, "schedule": schedule, "min_lr_ratio": min_lr_ratio, "full_attention": full_attention,
        "lora.rank": lora_rank, "lora.alpha": lora_alpha, "lora.dropout": lora_dropout, "lora.targets": lora_targets,
        "lora.train_norms": train_norms, "distill_weight": distill_weight, "temperature": temperature,
        "eval_sequences": eval_sequences, "eval_every": eval_every, "save_every": save_every,
        "keep_checkpoints": keep_checkpoints, "attn_implementation": attn_implementation,
        "mixed_precision": mixed_precision, "text_field": text_field, "seed": seed,
    }
    config = build_config(recipe, flags)
    quiet = logging.getLogger().level > logging.INFO
    report = recover(config, resume=resume, show_progress=not (no_progress or quiet))
    if os.environ.get("RANK", "0") != "0":  # under accelerate launch / torchrun only the main process reports
        return
    summary = {key: report[key] for key in ("steps", "tokens_trained", "final_loss", "tokens_per_second")}
    if report["evaluations"]:
        summary["perplexity_before"] = report["evaluations"][0]["perplexity"]
        summary["perplexity_after"] = report["evaluations"][-1]["perplexity"]
    typer.echo(json.dumps(summary))
    typer.echo(f"recovered model written to {config.out}")
