"""`mha2mla convert SOURCE OUT`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mha2mla.convert.options import build_options, load_recipe


def convert_command(
    source: str = typer.Argument(..., help="Hub id, local HF folder or .gguf file. With a recipe holding `source:`, give only OUT."),
    out: Optional[Path] = typer.Argument(None, help="Output folder (must not exist or be empty, unless --force)."),
    profile: Optional[str] = typer.Option(None, help="portable (default: transformers + vLLM + SGLang) or exact (transformers only, exact at full capacity)."),
    kv_budget: Optional[float] = typer.Option(None, help="Fraction of the source's KV values per token per layer to keep (default 0.25)."),
    kv_lora_rank: Optional[int] = typer.Option(None, help="The config's kv_lora_rank (what the cache stores; exact profile: constant channel included)."),
    rope_dim: Optional[int] = typer.Option(None, help="qk_rope_head_dim: size of the shared rope key (with --kv-lora-rank)."),
    rope_frequencies: Optional[str] = typer.Option(None, help="Which rope pairs to keep: high (default) or stride."),
    dtype: Optional[str] = typer.Option(None, help="auto (source dtype), float32, bfloat16 or float16."),
    calib: Optional[str] = typer.Option(None, help="Calibration text (file, folder or dataset id) for activation-aware initialisation."),
    calib_samples: Optional[int] = typer.Option(None, help="Calibration sequences."),
    calib_seq_len: Optional[int] = typer.Option(None, help="Tokens per calibration sequence."),
    calib_sequential: Optional[bool] = typer.Option(None, "--calib-sequential/--calib-source", help="Calibrate each layer on the converted layers' outputs (default), or on the source model's."),
    calib_device: Optional[str] = typer.Option(None, help="Device for the calibration forwards (default: cuda if available, else cpu)."),
    rope_mixing: Optional[str] = typer.Option(None, help="RoPE head mixing: auto, weight, activation or query (docs/calibration.md)."),
    lowrank: Optional[str] = typer.Option(None, help="Joint low rank of [K_nope; V]: auto, svd, pca, whiten, score or attention (docs/calibration.md)."),
    rope_compensation: Optional[str] = typer.Option(None, help="Dropped rotations: auto, none, or mean (their attention-weighted mean on the query side; calibrated)."),
    norm_calibration: Optional[str] = typer.Option(None, help="Portable kv_a_layernorm weight: auto, rms, mean, channel or stabilized."),
    refit: Optional[str] = typer.Option(None, help="Refit on the converted layer towards the source model: auto, none, values (V up-projections) or output (then o_proj too; calibrated)."),
    recipe: Optional[Path] = typer.Option(None, help="A recipe YAML holding these options (flags given here win)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (ranks, KV bytes/token, parameters) and write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Convert an MHA/GQA model into a native DeepSeek-V3 MLA checkpoint plus absorbed inference weights."""
    from mha2mla import UserError
    from mha2mla.convert.pipeline import convert
    from mha2mla.convert.plan import format_plan

    loaded = load_recipe(recipe) if recipe else None
    if out is None:  # `mha2mla convert --recipe R OUT`: the one argument is OUT
        if loaded is None or loaded.source is None:
            raise UserError("give both SOURCE and OUT (or a --recipe with `source:` and only OUT).")
        source, out = loaded.source, Path(source)
    options = build_options(
        loaded, profile=profile, kv_budget=kv_budget, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
        rope_frequencies=rope_frequencies, dtype=dtype, calib=calib, calib_samples=calib_samples,
        calib_seq_len=calib_seq_len, calib_sequential=calib_sequential, calib_device=calib_device,
        rope_mixing=rope_mixing, lowrank=lowrank, rope_compensation=rope_compensation, norm_calibration=norm_calibration,
        refit=refit,
    )
    result = convert(source, out, options, force=force, dry_run=dry_run, progress=progress)
    typer.echo(format_plan(result.plan))
    if dry_run:
        typer.echo("dry run: nothing written.")
        return
    layers = result.report["layers"]
    mean_k = sum(layer["k_rel_error"] for layer in layers) / len(layers)
    mean_v = sum(layer["v_rel_error"] for layer in layers) / len(layers)
    typer.echo(f"mean relative reconstruction error: K {mean_k:.4f}, V {mean_v:.4f}")
    typer.echo(f"wrote {out} in {result.report['elapsed_seconds']:.1f} s")


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_command)
