"""`mha2mla convert SOURCE OUT`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mha2mla.cli.settings import Flags, with_settings
from mha2mla.convert.config import ConvertConfig
from mha2mla.devices import check_device
from mha2mla.extras import require_gguf_reader
from mha2mla.io.source import check_source
from mha2mla.recipes import load_recipe

FLAGS = Flags(
    settings=("target", "profile", "kv_budget", "kv_lora_rank", "rope_dim", "dtype", "calib", "calib_samples",
              "calib_device", "compute_dtype", "reconstruct"),
    metavars={"calib": "TEXT", "calib_samples": "N", "calib_device": "DEVICE"},
)


@with_settings("convert", ConvertConfig, FLAGS)
def convert_command(
    settings: ConvertConfig,
    source: str = typer.Argument(..., help="Hub id, local HF folder or .gguf file. With a recipe holding `source:`, give only OUT."),
    out: Optional[Path] = typer.Argument(None, help="Output folder: new or empty, or with --force an earlier mha2mla output; never the source, inside it or the current folder."),
    recipe: Optional[Path] = typer.Option(None, help="A recipe YAML holding these options (flags given here win)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (ranks, method, KV bytes/token, parameters) and write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace OUT when it holds an earlier mha2mla output (a folder mha2mla did not write is never replaced)."),
    # hidden (the help lists at most 14 options): bars show only when stderr is a terminal (mha2mla/cli/main.py),
    # and --no-progress turns them off there too
    progress: bool = typer.Option(True, "--progress/--no-progress", hidden=True, help="Show progress bars on a terminal."),
) -> None:
    """Convert an MHA/GQA model into a native DeepSeek-V3 MLA checkpoint plus absorbed inference weights.

    Calibrated on the bundled sample unless --calib says otherwise (the best method: docs/benchmarks.md)."""
    from mha2mla import UserError

    if out is None:  # `mha2mla convert --recipe R OUT`: the one argument is OUT
        recipe_source = load_recipe(recipe).source if recipe else None
        if recipe_source is None:
            raise UserError("give both SOURCE and OUT (or a --recipe with `source:` and only OUT).")
        source, out = recipe_source, Path(source)
    check_source(source)  # the mistakes found without reading a model: one sentence before torch loads
    check_device(settings.calib_device, "--calib-device")
    require_gguf_reader(source)
    from mha2mla.convert.pipeline import convert  # checks OUT (convert.pipeline.prepare_out) before any work
    from mha2mla.convert.plan.engines import serving_command
    from mha2mla.convert.plan.summary import format_plan

    result = convert(source, out, settings, force=force, dry_run=dry_run, progress=progress)
    typer.echo(format_plan(result.plan) + "".join(f"\n{line}" for line in serving_command(result.plan, str(out))))
    if result.plan.calibration is not None:
        from mha2mla.convert.calibration.memory import layer_memory

        c = result.plan.calibration
        typer.echo(f"calibration: {c.samples} x {c.seq_len} tokens; one layer's working set about "
                   f"{sum(layer_memory(result.plan).values()) / 1024**3:.1f} GiB (docs/calibration.md, memory)")
    if not result.plan.calibrated:
        typer.echo("warning: weight-only conversion: expect much higher perplexity than the calibrated default "
                   "until `mha2mla recover` heals it (docs/benchmarks.md).", err=True)
    if dry_run:
        typer.echo("dry run: nothing written.")
        return
    report = result.report
    mean_k, mean_v = report.mean_errors()
    typer.echo(f"mean relative reconstruction error: K {mean_k:.4f}, V {mean_v:.4f}")
    typer.echo(f"wrote {out} in {report.elapsed_seconds:.1f} s (peak RSS {report.peak_rss_gib:.2f} GiB)")


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_command)
