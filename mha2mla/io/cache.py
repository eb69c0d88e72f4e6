"""The local cache folder and the layout of what ``make assets`` puts there.

One location for the CLI, the library, ``make`` and the recipes: ``$MHA2MLA_CACHE`` when set; else, when mha2mla runs
from a source checkout (the folder holding ``scripts/assets.py``, which fills the cache), that checkout's git-ignored
``.cache/`` -- the path the recipes and docs name as ``.cache/...``; else (an installed wheel) ``~/.cache/mha2mla``.
The library only reads from it and writes its own derived files (dequantised GGUF folders, eval task files, the healing
text of ``mha2mla.io.assets``); fetching the default model and the held-out texts runs package managers, so it is the
job of the checkout's entry point ``scripts/assets.py`` (``make assets``), which writes them to the paths below (see
docs/eval.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from mha2mla import UserError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub model that GGUF was made from (model cards)
# held-out text name -> what it is (its file is text/<name>.txt in the cache)
HELD_OUT_TEXTS = {"kjv": "the King James Bible", "python_docs": "the Python 3.11 documentation"}
# texts whose domains no healing text reads: the unseen-domain yardstick (docs/eval.md, "Unseen domains")
UNSEEN_TEXTS = {"fortunes": "the fortune-mod quotations and verse", "debian_policy": "the Debian Policy Manual"}
CACHED_TEXTS = {**HELD_OUT_TEXTS, **UNSEEN_TEXTS}  # every text make assets puts in text/<name>.txt
FETCH_HINT = "run `make assets` (or `python scripts/assets.py`) in the mha2mla checkout to fetch it"


def _checkout_cache() -> Path | None:
    """``<checkout>/.cache`` when this package runs from a source checkout (editable install or PYTHONPATH)."""
    root = Path(__file__).resolve().parents[2]
    return root / ".cache" if (root / "scripts" / "assets.py").is_file() else None


def cache_dir(create: bool = True) -> Path:
    """The cache folder, made when missing unless ``create`` is false (a reader that only looks for an entry)."""
    root = os.environ.get("MHA2MLA_CACHE") or _checkout_cache() or Path.home() / ".cache" / "mha2mla"
    path = Path(root)
    if not create:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the cache folder {path} ({error.strerror}); set MHA2MLA_CACHE to a folder you "
                        "can write.") from error
    return path


def default_model_path() -> Path:
    """Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives in the cache; it may be absent."""
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


def held_out_text_path(name: str) -> Path:
    """Where held-out text ``name`` (a key of ``CACHED_TEXTS``) lives in the cache; it may be absent."""
    if name not in CACHED_TEXTS:
        raise UserError(f"unknown held-out text {name!r}; choose one of {', '.join(CACHED_TEXTS)}.")
    return cache_dir() / "text" / f"{name}.txt"


def cached_default_model() -> Path:
    """The default model's GGUF file, or a UserError saying how to fetch it."""
    path = default_model_path()
    if not path.is_file():
        raise UserError(
            f"the default model {DEFAULT_MODEL_FILE} is not in {path.parent}; {FETCH_HINT}, "
            "or pass a model folder or .gguf file."
        )
    return path


def cached_held_out_text(name: str) -> Path:
    """The file of held-out text ``name``, or a UserError saying how to fetch it."""
    path = held_out_text_path(name)
    if not path.is_file():
        raise UserError(f"{CACHED_TEXTS[name]} text is not in {path}; {FETCH_HINT}.")
    return path


def text_source_path(name: str) -> Path:
    """The record beside cached text ``name`` of where ``make assets`` took it from (Debian package, version,
    files), ``text/<name>.source.json``; written for the unseen-domain texts, it may be absent."""
    return held_out_text_path(name).with_suffix(".source.json")
