"""The optional extras of ``pip install 'mha2mla[...]'`` and the one sentence a command says when its extra is missing.

The core install converts and inspects Hugging Face folders; each heavier feature names the modules its extra
installs, so a command can check them before any work starts (pyproject.toml lists the same extras)."""

from __future__ import annotations

import importlib.util

from mha2mla import UserError

EXTRAS = {
    "eval": ("lm_eval", "matplotlib", "gguf"),  # the default model of `mha2mla eval` is a GGUF file
    "recover": ("peft", "accelerate"),
    "gguf": ("gguf",),
    "kernels": ("triton",),
}


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require_extra(extra: str, what: str) -> None:
    """A UserError naming the extra to install when ``what`` (a command, a kind of input) needs a missing module."""
    missing = missing_modules(extra)
    if len(missing) == 1:
        raise UserError(f"{what} needs {missing[0]}, which is not installed; install it with "
                        f"`pip install 'mha2mla[{extra}]'`.")
    if missing:
        names = ", ".join(missing[:-1]) + " and " + missing[-1]
        raise UserError(f"{what} needs {names}, which are not installed; install them with "
                        f"`pip install 'mha2mla[{extra}]'`.")


def require_gguf_reader(*sources) -> None:
    """The gguf extra, when one of ``sources`` is a .gguf file."""
    if any(str(source).lower().endswith(".gguf") for source in sources if source is not None):
        require_extra("gguf", "reading a .gguf model")
