"""The ``mha2mla`` command. Each subcommand lives in ``mha2mla/cli/<name>.py`` and exposes
``register(app)``; this module only assembles them and turns every user mistake -- a UserError or a command line
that does not parse -- into one sentence on stderr and exit status 2."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

import typer

from mha2mla import UserError, __version__

COMMAND_MODULES = ["convert", "inspect", "eval", "recover", "generate", "export"]

app = typer.Typer(
    name="mha2mla",
    help="Convert MHA/GQA LLMs into native DeepSeek-V3 Multi-head Latent Attention checkpoints.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain text: `name[@split]` and the like are shown as written
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mha2mla {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    context: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Debug logging."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Only warnings and errors."),
) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s")
    if context.invoked_subcommand is None:  # `mha2mla` alone: the help, and the status of a usage error
        typer.echo(context.get_help(), err=True)
        raise typer.Exit(2)


for _name in COMMAND_MODULES:
    _module_name = f"mha2mla.cli.{_name}"
    if importlib.util.find_spec(_module_name) is not None:
        importlib.import_module(_module_name).register(app)


VALUE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "Path": "PATH"}


def _name_values(command) -> None:
    """Name what each option takes as click does (TEXT, INTEGER, PATH, [a|b]) instead of Typer's Python types
    (``<str>``, ``<list[str]>``, ``<bool>`` on flags); arguments by their name (SOURCE [OUT])."""
    for param in command.params:
        if param.metavar is not None or getattr(param, "is_flag", False):
            continue
        described = param.type_descriptor
        if param.param_type_name == "argument":
            param.metavar = param.name.upper()
        elif described.is_choice:
            param.metavar = "[" + "|".join(str(getattr(c, "value", c)) for c in described.choices) + "]"
        else:
            bare = param.bare_type().removeprefix("list[").removesuffix("]")
            param.metavar = "PATH" if described.is_path else VALUE_NAMES.get(bare, bare.upper())
    for sub in getattr(command, "commands", {}).values():
        _name_values(sub)


def _usage_sentence(error) -> str:
    """A command line that does not parse, as one line: what is wrong, and where the help is."""
    message = " ".join(error.format_message().replace("Value error, ", "").split())
    where = error.ctx.command_path if getattr(error, "ctx", None) is not None else "mha2mla"
    return f"{message.rstrip('.')}; see `{where} --help`."


def _fail(message: str, code: int) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    sys.exit(code)


def main() -> None:
    command = typer.main.get_command(app)
    _name_values(command)
    try:
        code = command.main(prog_name="mha2mla", standalone_mode=False)
    except typer.TyperException as error:  # the public base of the parse errors of typer's click
        usage = error.exit_code == 2  # click's UsageError and its subclasses: a command line that does not parse
        _fail(_usage_sentence(error) if usage else " ".join(error.format_message().split()), error.exit_code)
    except UserError as error:
        _fail(str(error), 2)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    if code == 130:  # Ctrl-C: typer turns KeyboardInterrupt into Exit(130), which standalone_mode=False returns
        _fail("interrupted; run the command again to finish (no partial output is kept).", 130)
    sys.exit(code if isinstance(code, int) else 0)  # as click's standalone mode: always through SystemExit


if __name__ == "__main__":
    main()
