"""The healing text of a recovery run given no ``--data`` (docs/recover.md, "No dataset: the default healing text").

A healed model has to work on text its users bring, not only on the text it trained on, so the default is general:
real text from several domains that the unseen-domain yardstick does not read (``mha2mla.io.assets.GENERAL_TEXTS``:
fiction, a programming textbook, software manuals; never the fortunes, the Debian Policy Manual or a dictionary),
compared with the in-domain text and teacher-generated text on that yardstick (docs/benchmarks.md, "Healing"). A
user who gives ``--data`` gets exactly that data and nothing from here.

The documents are a pure function of the cached texts and the seed: each text is cut into documents at line ends
(``mha2mla.io.assets.split_documents``), each text's documents are shuffled by a generator seeded from (seed, text
name), and the texts take turns, one document each, in GENERAL_TEXTS order, a text leaving the rotation once it runs
out; so a run's first rows hold every domain alike, whatever its token budget. ``general_data_path`` writes them once
per seed as ``{"text": ...}`` lines beside the texts (through a temporary name) and ``prepare_rows`` reads that file
as it reads any ``--data``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

from mha2mla.io.assets import GENERAL_TEXTS, cached_general_text, general_text_path, split_documents


def text_seed(seed: int, name: str) -> int:
    """The shuffling seed of text ``name`` in a mix seeded ``seed`` (independent of every other text's)."""
    digest = hashlib.sha256(f"mha2mla healing text {seed} {name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def take_turns(groups: Sequence[Sequence[str]]) -> list[str]:
    """One item of each group in turn, in group order; a group leaves the rotation once it runs out."""
    longest = max((len(group) for group in groups), default=0)
    return [group[i] for i in range(longest) for group in groups if i < len(group)]


def general_documents(texts: dict[str, str], seed: int) -> list[str]:
    """The documents of ``texts`` ({name: text}), each text's documents shuffled with ``text_seed(seed, name)``, the
    texts taking turns in the order given (module docstring)."""
    groups = []
    for name, text in texts.items():
        documents = [document.strip("\n") for document in split_documents(text) if document.strip()]
        random.Random(text_seed(seed, name)).shuffle(documents)
        groups.append(documents)
    return take_turns(groups)


def write_documents(target: Path, documents: Sequence[str]) -> Path:
    """``documents`` as ``{"text": ...}`` lines of ``target``, written through a temporary name."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part-{os.getpid()}")
    with open(part, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": document}) + "\n" for document in documents)
    os.replace(part, target)
    return target


def general_data_path(seed: int = 0) -> Path:
    """The default healing text for ``seed``: ``general_documents`` of every GENERAL_TEXTS text as
    ``text/general/healing_general-seed<seed>.jsonl`` in the cache, built on first use; a UserError with the fetch
    hint when a text is missing."""
    sources = {name: cached_general_text(name) for name in GENERAL_TEXTS}
    target = general_text_path(next(iter(GENERAL_TEXTS))).with_name(f"healing_general-seed{seed}.jsonl")
    if target.is_file():
        return target
    texts = {name: path.read_text(encoding="utf-8") for name, path in sources.items()}
    return write_documents(target, general_documents(texts, seed))


def default_data(config) -> list[str]:
    """The ``data`` a run given none trains on: the general healing text for its seed."""
    return [str(general_data_path(config.seed))]
