"""``mha2mla eval``: lm-evaluation-harness tasks, text perplexity, KV-cache size and speed of models against a baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from mha2mla.extras import require_extra
from mha2mla.io.source import check_source

ModelsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Model folders or .gguf files to evaluate (default: the SmolLM2-135M-Instruct GGUF that make assets caches)."
    ),
]
BaselineOpt = Annotated[
    str | None,
    typer.Option("--baseline", "-b", help="Source model to compare against (folder, .gguf, or 'default')."),
]
TasksOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tasks",
        "-t",
        help="lm-eval tasks, comma-separated or repeated (default: the bundled tasks available here).",
    ),
]
LimitOpt = Annotated[
    float | None, typer.Option("--limit", "-l", help="Documents per task (a value below 1 is a fraction).")
]
OutOpt = Annotated[
    Path | None, typer.Option("--out", "-o", help="Folder for results.json, results.md and the plots (default: eval).")
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available).")
]
BatchOpt = Annotated[int | None, typer.Option("--batch-size", help="lm-eval batch size (default: 1).")]
SeedOpt = Annotated[
    int | None,
    typer.Option("--seed", help="Seed for every random source of lm-eval, the same for the baseline (default: 1234)."),
]
DtypeOpt = Annotated[
    Literal["auto", "float32", "bfloat16", "float16"] | None,
    typer.Option("--dtype", help="auto (the checkpoint's own, the default), float32, bfloat16 or float16."),
]
TextOpt = Annotated[
    Path | None,
    typer.Option(
        "--text",
        help="A UTF-8 text file to score for token perplexity (offline); alone, it replaces the default tasks.",
    ),
]
TextTokensOpt = Annotated[
    int | None, typer.Option("--text-tokens", help="Tokens read from the start of --text (default: 16384).")
]
RecipeOpt = Annotated[
    Path | None,
    typer.Option("--recipe", "-r", help="Recipe YAML whose eval: section gives the settings; options here win."),
]


def eval_command(
    models: ModelsArg = None,
    baseline: BaselineOpt = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    seed: SeedOpt = None,
    dtype: DtypeOpt = None,
    text: TextOpt = None,
    text_tokens: TextTokensOpt = None,
    recipe: RecipeOpt = None,
) -> None:
    """Evaluate MODELs (and a --baseline) with the same tasks, limit and seed; print and save the comparison."""
    require_extra("eval", "`mha2mla eval`")
    for spec in [*(models or []), baseline]:  # a mistyped path is one sentence before torch and lm-eval load
        if spec not in (None, "default"):
            check_source(spec)
    from mha2mla.evaluation import run_eval
    from mha2mla.evaluation.compare import DEFAULT_OUT
    from mha2mla.evaluation.recipe import load_eval_settings, merge_settings

    settings = merge_settings(
        load_eval_settings(recipe) if recipe is not None else None,
        baseline=baseline,
        tasks=tasks,
        limit=limit,
        out=out,
        device=device,
        batch_size=batch_size,
        seed=seed,
        dtype=dtype,
        text=text,
        text_tokens=text_tokens,
    )
    report = run_eval(models or ["default"], **settings)
    typer.echo(report["markdown"])
    folder = Path(settings.get("out", DEFAULT_OUT))
    written = [folder / "results.json", folder / "results.md", *report["plots"].values()]
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
