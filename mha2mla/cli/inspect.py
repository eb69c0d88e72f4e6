"""`mha2mla inspect MODEL`."""

from __future__ import annotations

import json

import typer

from mha2mla.extras import require_gguf_reader
from mha2mla.io.source import check_source


def inspect_command(
    model: str = typer.Argument(..., help="Hub id, local HF folder or .gguf file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Family, heads, head dim, RoPE, KV bytes per token (in the dtype a conversion writes), and which budgets are
    reachable."""
    check_source(model)  # a mistyped path is one sentence before torch loads
    require_gguf_reader(model)
    from mha2mla.inspection import inspect_model

    info = inspect_model(model)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key == "budgets":
            typer.echo(f"reachable budgets (kv_lora_rank + rope_dim per layer; bytes in {info['kv_dtype'].split(' ')[0]}):")
            for row in value:
                typer.echo(f"  {row['kv_budget']:>6.4f}: {row['values_per_token_per_layer']:>5} values = "
                           f"kv_lora_rank {row['kv_lora_rank']} + rope_dim {row['rope_dim']}, {row['kv_bytes_per_token']:,} B/token")
        else:
            typer.echo(f"{key}: {value}")


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)
