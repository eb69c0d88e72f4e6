"""``mha2mla eval``: lm-evaluation-harness tasks, KV-cache size and speed of models against a baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Model folders or .gguf files to evaluate (default: the SmolLM2-135M-Instruct GGUF)."
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
        help="lm-eval tasks, comma-separated or repeated (default: the bundled offline tasks).",
    ),
]
LimitOpt = Annotated[
    float | None, typer.Option("--limit", "-l", help="Documents per task (a value below 1 is a fraction).")
]
OutOpt = Annotated[
    Path, typer.Option("--out", "-o", help="Folder for results.json, results.md and the plots.")
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available).")
]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="lm-eval batch size.")]
SeedOpt = Annotated[
    int, typer.Option("--seed", help="Seed for every random source of lm-eval (same for the baseline).")
]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="auto (the checkpoint's own), float32, bfloat16 or float16.")
]


def eval_command(
    models: ModelsArg = None,
    baseline: BaselineOpt = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    out: OutOpt = Path("eval"),
    device: DeviceOpt = None,
    batch_size: BatchOpt = 1,
    seed: SeedOpt = 1234,
    dtype: DtypeOpt = "auto",
) -> None:
    """Evaluate MODELs (and a --baseline) with the same tasks, limit and seed; print and save the comparison."""
    from mha2mla.evaluation import run_eval

    report = run_eval(
        models or ["default"],
        baseline=baseline,
        tasks=tasks,
        limit=limit,
        out=out,
        device=device,
        batch_size=batch_size,
        seed=seed,
        dtype=dtype,
    )
    typer.echo(report["markdown"])
    written = [out / "results.json", out / "results.md", *report["plots"].values()]
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
