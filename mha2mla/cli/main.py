"""The ``mha2mla`` command. Each subcommand lives in ``mha2mla/cli/<name>.py`` and exposes
``register(app)``; this module only assembles them and turns user errors into one sentence."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

import typer

from mha2mla import UserError, __version__

COMMAND_MODULES = ["convert", "inspect", "eval", "recover", "generate"]

app = typer.Typer(
    name="mha2mla",
    help="Convert MHA/GQA LLMs into native DeepSeek-V3 Multi-head Latent Attention checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mha2mla {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Debug logging."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Only warnings and errors."),
) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s")


for _name in COMMAND_MODULES:
    _module_name = f"mha2mla.cli.{_name}"
    if importlib.util.find_spec(_module_name) is not None:
        importlib.import_module(_module_name).register(app)


def main() -> None:
    try:
        app()
    except UserError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
