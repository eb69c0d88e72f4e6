"""`mha2mla convert SOURCE OUT`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mha2mla.convert.options import ConvertOptions, build_options, load_recipe
from mha2mla.io.output import check_destination, check_replaceable
from mha2mla.io.source import check_source

# the choices of ConvertOptions, checked while the command line is read (before any heavy import)
Target = ConvertOptions.model_fields["target"].annotation
Profile = ConvertOptions.model_fields["profile"].annotation
Dtype = ConvertOptions.model_fields["dtype"].annotation


def convert_command(
    source: str = typer.Argument(..., help="Hub id, local HF folder or .gguf file. With a recipe holding `source:`, give only OUT."),
    out: Optional[Path] = typer.Argument(None, help="Output folder: new or empty, or with --force an earlier mha2mla output; never the source or the current folder."),
    target: Optional[Target] = typer.Option(None, help="transformers (default), vllm, sglang or llama.cpp: the engine whose loader and fast kernels the shapes must suit (docs/engines.md)."),
    profile: Optional[Profile] = typer.Option(None, help="portable (default: what serving engines build — no attention biases, silu, interleaved plain rope; --target picks the shapes) or exact (transformers only, exact at full capacity)."),
    kv_budget: Optional[float] = typer.Option(None, help="Fraction of the source's KV values per token per layer to keep (default 0.25)."),
    kv_lora_rank: Optional[int] = typer.Option(None, help="The config's kv_lora_rank (what the cache stores), with --rope-dim instead of --kv-budget."),
    rope_dim: Optional[int] = typer.Option(None, help="qk_rope_head_dim: size of the shared rope key (with --kv-lora-rank)."),
    dtype: Optional[Dtype] = typer.Option(None, help="Output dtype: auto (the source's, the default), float32, bfloat16 or float16."),
    calib: Optional[str] = typer.Option(None, metavar="TEXT", help="Calibration text: `default` (the bundled sample, the default), a .txt/.jsonl/.parquet file, a folder or a dataset id; `none` for the fast weight-only path (poor quality without `mha2mla recover`)."),
    calib_samples: Optional[int] = typer.Option(None, metavar="N", help="Calibration sequences of 256 tokens (default 256, 128 past hidden size 4096; fewer is faster and worse; `calib_seq_len` in a recipe sets their length)."),
    calib_device: Optional[str] = typer.Option(None, metavar="DEVICE", help="Device for calibration (cpu, cuda, cuda:1; default cuda if available)."),
    reconstruct: Optional[bool] = typer.Option(None, "--reconstruct/--no-reconstruct", help="Fit each calibrated layer to the source layer by gradient descent (the default; --no-reconstruct is faster and worse, docs/calibration.md)."),
    recipe: Optional[Path] = typer.Option(None, help="A recipe YAML holding these options (flags given here win)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (ranks, method, KV bytes/token, parameters) and write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace OUT when it holds an earlier mha2mla output (a folder mha2mla did not write is never replaced)."),
    # hidden: the bar shows by default; --no-progress for scripts (kept off the help, which lists at most 14 options)
    progress: bool = typer.Option(True, "--progress/--no-progress", hidden=True, help="Show a progress bar."),
) -> None:
    """Convert an MHA/GQA model into a native DeepSeek-V3 MLA checkpoint plus absorbed inference weights.

    Calibrated on the bundled sample unless --calib says otherwise (the best method measured)."""
    from mha2mla import UserError

    loaded = load_recipe(recipe) if recipe else None
    if out is None:  # `mha2mla convert --recipe R OUT`: the one argument is OUT
        if loaded is None or loaded.source is None:
            raise UserError("give both SOURCE and OUT (or a --recipe with `source:` and only OUT).")
        source, out = loaded.source, Path(source)
    options = build_options(
        loaded, target=target, profile=profile, kv_budget=kv_budget, kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim, dtype=dtype, calib=calib, calib_samples=calib_samples,
        calib_device=calib_device, reconstruct=reconstruct,
    )
    check_source(source)  # the mistakes found without reading a model: one sentence before torch loads
    if not dry_run:
        check_destination(out, [("the source model", source)])
        check_replaceable(out, force)
    from mha2mla.convert.engines import serving_command
    from mha2mla.convert.pipeline import convert
    from mha2mla.convert.plan import format_plan

    result = convert(source, out, options, force=force, dry_run=dry_run, progress=progress)
    typer.echo(format_plan(result.plan) + "".join(f"\n{line}" for line in serving_command(result.plan, str(out))))
    if result.plan.calibration is not None:
        from mha2mla.convert.memory import layer_memory

        c = result.plan.calibration
        typer.echo(f"calibration: {c.samples} x {c.seq_len} tokens; one layer's working set about "
                   f"{sum(layer_memory(result.plan).values()) / 1024**3:.1f} GiB (docs/calibration.md, memory)")
    if not result.plan.calibrated:
        typer.echo("warning: weight-only conversion: expect much higher perplexity than the calibrated default "
                   "until `mha2mla recover` heals it (docs/benchmarks.md).", err=True)
    if dry_run:
        typer.echo("dry run: nothing written.")
        return
    layers = result.report["layers"]
    mean_k = sum(layer["k_rel_error"] for layer in layers) / len(layers)
    mean_v = sum(layer["v_rel_error"] for layer in layers) / len(layers)
    typer.echo(f"mean relative reconstruction error: K {mean_k:.4f}, V {mean_v:.4f}")
    typer.echo(f"wrote {out} in {result.report['elapsed_seconds']:.1f} s (peak RSS {result.report['peak_rss_gib']:.2f} GiB)")


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_command)
