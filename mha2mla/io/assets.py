"""The texts as library code: the recovery training text derived from the held-out texts in the cache (docs/recover.md,
"Healing SmolLM2"), and where the general healing texts that ``make assets`` fetches live.

The project's assets, one function per fact: the default model's GGUF file is ``mha2mla.io.cache.cached_default_model``,
each held-out text's file ``mha2mla.io.cache.cached_held_out_text``, the evaluation slice of a text
``mha2mla.data.held_out.held_out_token_ids`` and the healing text ``healing_text_path`` here. Fetching the model and
the texts runs package managers, so it stays in the checkout's ``scripts/assets.py`` (``make assets``); these
functions read the cache and raise ``UserError`` with the fetch hint when something is missing. The healing text is
the library's own derived file: built from the cached texts on first use, written through a temporary name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.cache import FETCH_HINT, cache_dir, cached_held_out_text

HEALING_FRACTION = 0.30  # the training part of each text: its start, far from the held-out slice a third in
DOCUMENT_CHARACTERS = 4000  # the size of one training document, cut at a line end
HEALING_TEXTS = ("kjv", "python_docs")  # the held-out texts whose first part the healing text reads
HEALING_FILES = {False: "healing_documents.jsonl", True: "healing_balanced.jsonl"}  # by ``balanced``


def split_documents(text: str, size: int = DOCUMENT_CHARACTERS) -> list[str]:
    """``text`` cut at line ends into documents of about ``size`` characters (the last one may be shorter)."""
    documents, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            documents.append("".join(current))
            current, length = [], 0
    if current:
        documents.append("".join(current))
    return documents


def healing_documents(texts: list[str], balanced: bool = False) -> list[str]:
    """The recovery training documents from ``texts``: every document of the first HEALING_FRACTION of each text
    (cut at a line end), so each text weighs as much as it is long, interleaved by position (a document a fifth into
    its text sits beside the others' documents a fifth in). ``balanced``: as many documents from each text as the
    shortest part has, taken at even strides through the longer parts (so they span the whole first
    HEALING_FRACTION), one from each text in turn: the texts weigh alike."""
    parts = [split_documents(text[: text.rfind("\n", 0, int(len(text) * HEALING_FRACTION)) + 1]) for text in texts]
    if balanced:
        count = min(len(part) for part in parts)
        spread = [[part[i * len(part) // count] for i in range(count)] for part in parts]
        return [doc for group in zip(*spread) for doc in group]
    keyed = [(i / len(part), t, doc) for t, part in enumerate(parts) for i, doc in enumerate(part)]
    return [doc for _, _, doc in sorted(keyed, key=lambda item: item[:2])]


def healing_text_path(balanced: bool = False) -> Path:
    """The healing text: ``healing_documents`` of the KJV and of the Python docs as ``{"text": ...}`` lines of
    ``healing_documents.jsonl`` (``balanced``: ``healing_balanced.jsonl``, the 12.5% recipe's) beside the cached
    texts, built on first use; a UserError with the fetch hint when a text is missing."""
    sources = [cached_held_out_text(name) for name in HEALING_TEXTS]
    target = sources[0].with_name(HEALING_FILES[balanced])
    if target.is_file():
        return target
    texts = [path.read_text(encoding="utf-8") for path in sources]
    part = target.with_name(target.name + ".part")
    with open(part, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": doc}) + "\n" for doc in healing_documents(texts, balanced))
    os.replace(part, target)
    return target


# ---------------------------------------------------------------- the general healing texts (docs/recover.md)
# Real text from domains that neither the yardstick (fortunes, Debian policy) nor an independent dictionary check
# reads, one file each in the cache's text/general/ folder, fetched by ``make assets`` from Debian packages
# and cleaned by benchmarks/asset_texts.py.
GENERAL_TEXTS = {
    "austen": "Jane Austen's six novels (fiction: narration and dialogue; r-cran-janeaustenr)",
    "cpp_annotations": "the C++ Annotations (a programming textbook; c++-annotations-txt)",
    "git_docs": "Git's user manual, tutorials and command manuals (software manuals; git-doc)",
}


def general_text_path(name: str) -> Path:
    """Where general healing text ``name`` (a key of GENERAL_TEXTS) lives in the cache; it may be absent."""
    if name not in GENERAL_TEXTS:
        raise UserError(f"unknown general text {name!r}; choose one of {', '.join(GENERAL_TEXTS)}.")
    return cache_dir() / "text" / "general" / f"{name}.txt"


def cached_general_text(name: str) -> Path:
    """The file of general healing text ``name``, or a UserError saying what to pass instead (``recover --data``) and
    how to fetch it: an installed package has no texts until ``make assets`` runs in a checkout."""
    path = general_text_path(name)
    if not path.is_file():
        raise UserError(f"recover's default training text needs {GENERAL_TEXTS[name]}, which is not in {path}; pass "
                        f"your own text with --data FILE, or {FETCH_HINT}.")
    return path
