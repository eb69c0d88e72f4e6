"""The ``mha2mla`` command. Each subcommand lives in ``mha2mla/cli/<name>.py`` and exposes
``register(app)``; this module only assembles them and turns every user mistake -- a UserError or a command line
that does not parse -- into one sentence on stderr and exit status 2, and an interruption -- Ctrl-C (SIGINT) or
SIGTERM (what ``timeout``, ``docker stop``, Slurm and systemd send) -- into one sentence and exit status 130 or 143,
after every staging folder has been removed on the way out (the writers clean up on any exception)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import signal
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


# A command's progress flag -> its value when bars are wanted (convert's --progress, recover's --no-progress).
PROGRESS_PARAMETERS = {"progress": True, "no_progress": False}


def progress_shown(asked: bool = True) -> bool:
    """Whether a command draws progress bars: asked for (no --no-progress), not -q, and stderr a terminal -- in a
    pipe or a log file every redraw of a bar would be one more run of carriage returns."""
    return asked and sys.stderr.isatty() and logging.getLogger().level <= logging.INFO


_shown_again: list = []  # what shows the bars hide_library_progress_bars hid, for when main() returns


def hide_library_progress_bars() -> None:
    """Turn off the bars of transformers and huggingface_hub (Loading weights, Writing model shards, downloads),
    whether they are imported yet or not: transformers takes huggingface_hub's setting when first imported."""
    from huggingface_hub import utils as hub

    if not hub.are_progress_bars_disabled():
        hub.disable_progress_bars()
        _shown_again.append(hub.enable_progress_bars)
    loaded = sys.modules.get("transformers.utils.logging")
    if loaded is not None and loaded.is_progress_bar_enabled():
        loaded.disable_progress_bar()
        _shown_again.append(loaded.enable_progress_bar)


def _show_library_progress_bars_again() -> None:
    while _shown_again:
        _shown_again.pop()()


def _settle_progress(callback):
    """``callback`` run with its progress flag turned off where bars are not shown (progress_shown), and with the
    libraries' bars hidden whenever its own are: every command gets the same rule, whatever its flag."""

    @functools.wraps(callback)
    def run(*args, **kwargs):
        asked = all(kwargs.get(name, wanted) == wanted for name, wanted in PROGRESS_PARAMETERS.items())
        if not progress_shown(asked):
            hide_library_progress_bars()
            kwargs.update({name: not wanted for name, wanted in PROGRESS_PARAMETERS.items() if name in kwargs})
        return callback(*args, **kwargs)

    return run


VALUE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "Path": "PATH"}


def _name_values(command) -> None:
    """Name what each option takes as click does (TEXT, INTEGER, PATH, [a|b]) instead of Typer's Python types
    (``<str>``, ``<list[str]>``, ``<bool>`` on flags); arguments by their name (SOURCE [OUT])."""
    for param in command.params:
        if param.param_type_name == "argument":
            param.get_usage_pieces = _usage_pieces(param)
        if param.metavar is not None or getattr(param, "is_flag", False):
            continue
        described = param.type_descriptor
        if param.param_type_name == "argument":
            param.metavar = param.name.upper()
            param.display_type_rich = lambda ctx: None  # the help row is the name alone, not `SOURCE <str>`
        elif described.is_choice:
            param.metavar = "[" + "|".join(str(getattr(c, "value", c)) for c in described.choices) + "]"
        else:
            bare = param.bare_type().removeprefix("list[").removesuffix("]")
            param.metavar = "PATH" if described.is_path else VALUE_NAMES.get(bare, bare.upper())
    for sub in getattr(command, "commands", {}).values():
        _name_values(sub)
        sub.callback = _settle_progress(sub.callback)


def _usage_pieces(argument):
    """An argument in the usage line as click writes it (SOURCE, [OUT], [MODELS]...), not Typer's {SOURCE}."""

    def pieces(ctx) -> list[str]:
        name = argument.metavar or argument.name.upper()
        return [(name if argument.required else f"[{name}]") + ("..." if argument.nargs != 1 else "")]

    return pieces


def _usage_sentence(error) -> str:
    """A command line that does not parse, as one line: what is wrong, and where the help is."""
    message = " ".join(error.format_message().replace("Value error, ", "").split())
    where = error.ctx.command_path if getattr(error, "ctx", None) is not None else "mha2mla"
    return f"{message.rstrip('.')}; see `{where} --help`."


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as a KeyboardInterrupt so that every cleanup written for Ctrl-C runs (the
    staging folders, recover's run); only the sentence and the exit status (143) differ."""


_received = {"sigterm": False}


def _terminate(signum, frame) -> None:
    _received["sigterm"] = True
    raise Terminated


# What an interruption leaves, per command: the writers stage their output and remove it on the way out, and a
# recover run keeps the checkpoints it saved.
_AFTER_INTERRUPT = {
    "recover": "the checkpoints already saved in --out are kept; run the same command with --resume auto to continue",
    "eval": "no results were written; run the command again",
}
_DEFAULT_AFTER_INTERRUPT = "nothing partial was kept; run the command again to finish"


def _command_name(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _interrupted(message: str | None = None) -> None:
    """One sentence for Ctrl-C or SIGTERM; ``message``: what the command said about it (recover's run)."""
    message = message or f"interrupted; {_AFTER_INTERRUPT.get(_command_name(sys.argv[1:]), _DEFAULT_AFTER_INTERRUPT)}."
    if _received["sigterm"]:
        _fail(message.replace("interrupted", "terminated (SIGTERM)", 1), 143)
    _fail(message, 130)


def _fail(message: str, code: int) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    sys.exit(code)


def _run(command) -> None:
    try:
        code = command.main(prog_name="mha2mla", standalone_mode=False)
    except typer.TyperException as error:  # the public base of the parse errors of typer's click
        usage = error.exit_code == 2  # click's UsageError and its subclasses: a command line that does not parse
        _fail(_usage_sentence(error) if usage else " ".join(error.format_message().split()), error.exit_code)
    except UserError as error:
        if getattr(error, "exit_code", 2) == 130:  # an interruption the command put in words (recover's run)
            _interrupted(str(error))
        _fail(str(error), 2)
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    if code == 130:  # Ctrl-C: typer turns KeyboardInterrupt into Exit(130), which standalone_mode=False returns
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)  # as click's standalone mode: always through SystemExit


def main() -> None:
    command = typer.main.get_command(app)
    _name_values(command)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        _run(command)
    finally:  # the caller's handler and progress bars again (main() also runs in-process, under tests)
        signal.signal(signal.SIGTERM, previous)
        _received["sigterm"] = False
        _show_library_progress_bars_again()


if __name__ == "__main__":
    main()
