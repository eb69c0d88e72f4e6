"""What mha2mla wrote into an output folder, so that --force replaces only that (mha2mla/io/output.py).

Every output folder carries a marker (a report or a recover run's settings) and a list of its own top-level
entries, :data:`MANIFEST`, written last into the staging folder. A recover run folder's checkpoints and log are known
by name, and a folder written before the list existed is judged by the names a conversion writes.
"""

from __future__ import annotations

import re
from pathlib import Path

from mha2mla.io.model_folder import CONVERSION_REPORT, RECOVER_CONFIG, RECOVERY_REPORT

# A folder holding one of these was written by mha2mla (convert, recover's export, a recover run folder).
MARKERS = (CONVERSION_REPORT, RECOVERY_REPORT, RECOVER_CONFIG)

# The top-level names mha2mla wrote into an output folder, one per line; written last into the staging folder.
MANIFEST = ".mha2mla_files"
# What a recover run folder accumulates while it trains (mha2mla/train/checkpoint.py, log.py): ours without a manifest.
_RUN_ENTRIES = re.compile(r"^(step-\d+|checkpoints|train_log\.jsonl|recover_config\.json)$")
# What a conversion writes (a folder written before manifests existed has no list of its own): config, weights,
# tokenizer, card, reports.
_OUTPUT_ENTRIES = re.compile(
    r"^(config\.json|generation_config\.json|README\.md|conversion_report\.json|recovery_report\.json|"
    r"(model|absorbed)(-\d+-of-\d+)?\.safetensors|(model|absorbed)\.safetensors\.index\.json|absorbed\.json|"
    r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|tokenizer\.model|vocab\.json|merges\.txt|"
    r"added_tokens\.json|chat_template\.jinja|chat_template\.json)$"
)


def is_ours(folder: Path) -> bool:
    """True when ``folder`` carries one of mha2mla's MARKERS."""
    return any((Path(folder) / marker).is_file() for marker in MARKERS)


def written_names(folder: Path) -> set[str] | None:
    """The names :data:`MANIFEST` lists, or None when the folder has none (written before manifests existed)."""
    try:
        return set((Path(folder) / MANIFEST).read_text(encoding="utf-8").split("\n")) - {""}
    except (OSError, UnicodeDecodeError):
        return None


def foreign_entries(folder: Path) -> list[str]:
    """The entries of an mha2mla output folder that mha2mla did not write there (sorted; folders end in /)."""
    folder = Path(folder)
    listed = written_names(folder)
    foreign = []
    for entry in sorted(folder.iterdir()):
        known = entry.name in listed if listed is not None else bool(_OUTPUT_ENTRIES.match(entry.name))
        if not (known or entry.name == MANIFEST or _RUN_ENTRIES.match(entry.name)):
            foreign.append(entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
    return foreign


def write_manifest(folder: Path) -> None:
    """List ``folder``'s top-level entries as mha2mla's own (what a later --force may replace)."""
    names = sorted(entry.name for entry in Path(folder).iterdir() if entry.name != MANIFEST)
    (Path(folder) / MANIFEST).write_text("".join(name + "\n" for name in names), encoding="utf-8")
