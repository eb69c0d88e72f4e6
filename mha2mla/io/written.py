"""What mha2mla wrote into an output folder, so that --force replaces only that (mha2mla/io/output.py).

Every output folder carries a marker (a report or a recover run's settings) and a list of its own top-level
entries, :data:`MANIFEST`: written last into the staging folder of a model, and kept up to date in a recover run
folder (its checkpoints are listed when the first is saved, removed from the list when they are). The list is the
only word on what is mha2mla's: no name counts as its own because of its shape, and a folder without the list (an
mha2mla from before it existed) is not replaced. Small files are listed with the SHA-256 of what was written, so a
file edited since (the model card, the config) is known and kept too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from mha2mla.io.model_folder import CONVERSION_REPORT, MANIFEST, RECOVER_CONFIG, RECOVERY_REPORT
from mha2mla.io.staging import staging_path

# A folder holding one of these was written by mha2mla (convert, recover's export, a recover run folder).
MARKERS = (CONVERSION_REPORT, RECOVERY_REPORT, RECOVER_CONFIG)

# The top-level names mha2mla wrote into an output folder, one per line (``NAME`` or ``NAME<TAB>SHA256``).
HASHED_BYTES = 1024**2  # files up to this size are listed with their hash (cards, configs, reports)
_CHECKPOINT = re.compile(r"^step-\d{6,}$")  # a recover run's checkpoint folder (mha2mla/train/state/checkpoint.py)


def is_ours(folder: Path) -> bool:
    """True when ``folder`` carries one of mha2mla's MARKERS."""
    return any((Path(folder) / marker).is_file() for marker in MARKERS)


def file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def written_names(folder: Path) -> dict[str, str | None] | None:
    """The names :data:`MANIFEST` lists, each with the hash it was written with (None: not hashed), or None when
    the folder has no list."""
    try:
        lines = (Path(folder) / MANIFEST).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError):
        return None
    listed = {}
    for line in filter(None, lines):
        name, _, digest = line.partition("\t")
        listed[name] = digest or None
    return listed


def _write_list(folder: Path, listed: dict[str, str | None]) -> None:
    """Replace ``folder``'s list in one rename, so a kill never leaves half of it."""
    staged = staging_path(Path(folder) / MANIFEST)
    text = "".join(name + (f"\t{digest}" if digest else "") + "\n" for name, digest in sorted(listed.items()))
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, Path(folder) / MANIFEST)


def write_manifest(folder: Path) -> None:
    """List ``folder``'s top-level entries as mha2mla's own (what a later --force may replace); small files with
    their hash."""
    listed = {}
    for entry in Path(folder).iterdir():
        if entry.name == MANIFEST:
            continue
        small = entry.is_file() and not entry.is_symlink() and entry.stat().st_size <= HASHED_BYTES
        listed[entry.name] = file_hash(entry) if small else None
    _write_list(folder, listed)


def record_written(folder: Path, listed: dict[str, str | None]) -> None:
    """Add ``listed`` (name -> hash or None) to ``folder``'s list, made when there is none: what a recover run
    writes into its folder while it trains."""
    current = written_names(folder) or {}
    if any(current.get(name, "") != digest for name, digest in listed.items()):
        _write_list(folder, {**current, **listed})


def forget_written(folder: Path, names: Iterable[str]) -> None:
    """Take ``names`` off ``folder``'s list (what mha2mla removed; what is left under such a name is not its)."""
    names, current = set(names), written_names(folder)
    if current is not None and names & current.keys():
        _write_list(folder, {name: digest for name, digest in current.items() if name not in names})


def _shown(entry: Path) -> str:
    return entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else "")


def foreign_entries(folder: Path) -> list[str]:
    """The entries of an mha2mla output folder that its list does not name (sorted; folders end in /); every entry
    when there is no list."""
    listed = written_names(folder) or {}
    return [_shown(entry) for entry in sorted(Path(folder).iterdir()) if entry.name not in {*listed, MANIFEST}]


def changed_entries(folder: Path) -> list[str]:
    """The listed files of ``folder`` whose content is no longer what mha2mla wrote (edited by hand, or replaced)."""
    changed = []
    for name, digest in sorted((written_names(folder) or {}).items()):
        path = Path(folder) / name
        if digest and os.path.lexists(path):
            same = path.is_file() and not path.is_symlink() and path.stat().st_size <= HASHED_BYTES and file_hash(path) == digest
            if not same:
                changed.append(name)
    return changed


def checkpoint_entries(folder: Path) -> list[str]:
    """The recover checkpoint folders in ``folder`` (``checkpoints/step-N``): what an interrupted run resumes from,
    never replaced by --force."""
    sub = Path(folder) / "checkpoints"
    if not sub.is_dir() or sub.is_symlink():
        return []
    return [str(entry.relative_to(folder)) for entry in sorted(sub.iterdir())
            if _CHECKPOINT.match(entry.name) and entry.is_dir()]
