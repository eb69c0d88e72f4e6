"""``mha2mla eval``: lm-evaluation-harness tasks, text perplexity, KV-cache size and speed of models against a
baseline. The options and their help are EvalConfig's fields (mha2mla/cli/settings.py; docs/eval.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mha2mla.cli.settings import Flags, with_settings
from mha2mla.evaluation.config import EvalConfig
from mha2mla.extras import require_extra
from mha2mla.io.source import check_source

FLAGS = Flags(
    settings=("baseline", "tasks", "limit", "out", "device", "batch_size", "seed", "dtype", "text", "text_tokens"),
    arguments=("models",),
    names={"baseline": ("--baseline", "-b"), "tasks": ("--tasks", "-t"), "limit": ("--limit", "-l"),
           "out": ("--out", "-o")},
    metavars={"out": "PATH", "text": "PATH"},
)
ModelsArg = Annotated[list[str] | None, typer.Argument(help="Model folders or .gguf files to evaluate (the "
                                                            "SmolLM2-135M-Instruct GGUF that make assets caches if none).")]
RecipeOpt = Annotated[Path | None, typer.Option("--recipe", "-r", help="Recipe YAML whose eval: section gives the "
                                                                       "settings; options here win.")]


@with_settings("eval", EvalConfig, FLAGS)
def eval_command(settings: EvalConfig, models: ModelsArg = None, recipe: RecipeOpt = None) -> None:
    """Evaluate MODELs (and a --baseline) with the same tasks, limit and seed; print and save the comparison."""
    require_extra("eval", "`mha2mla eval`")
    for spec in [*settings.models, settings.baseline]:  # a mistyped path is one sentence before torch and lm-eval load
        if spec not in (None, "default"):
            check_source(spec)
    from mha2mla.evaluation import run_eval

    report = run_eval(settings)
    typer.echo(report["markdown"])
    folder = Path(settings.out)
    written = [folder / "results.json", folder / "results.md", *report["plots"].values()]
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
