"""`mha2mla export-gguf MODEL OUT.gguf`: a converted checkpoint as a llama.cpp GGUF (docs/engines.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mha2mla.extras import require_extra


def export_gguf_command(
    model: Path = typer.Argument(..., help="A folder written by `mha2mla convert` (portable profile)."),
    out: Path = typer.Argument(..., help="The .gguf file to write."),
    tensor_type: str = typer.Option("f16", "--type", metavar="TYPE", help="Matrix type: f16, f32, bf16 or a q* block type the gguf package writes (docs/engines.md; norms stay f32, attn_kv_a_mqa f16 under q*)."),
    pre: Optional[str] = typer.Option(None, "--pre", metavar="NAME", help="llama.cpp pre-tokenizer name, when the tokenizer's is not recognised."),
    force: bool = typer.Option(False, "--force", help="Replace an existing OUT."),
) -> None:
    """Write MODEL as a GGUF that llama.cpp runs as deepseek2, caching kv_lora_rank + rope dims per token and layer."""
    require_extra("gguf", "`mha2mla export-gguf`")
    from mha2mla.export.gguf import export_gguf  # torch and transformers load only when a command runs

    path = export_gguf(model, out, tensor_type, force=force, pre_tokenizer=pre)
    typer.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {tensor_type})")


def register(app: typer.Typer) -> None:
    app.command("export-gguf")(export_gguf_command)
