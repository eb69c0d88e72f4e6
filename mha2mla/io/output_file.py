"""Where mha2mla writes files rather than a model folder (``export-gguf``'s OUT, ``eval``'s results folder), with the
rules of io/output.py for folders: OUT is never a link, a folder, an input or inside one, and lies in a folder that
can be written; an existing OUT is replaced only with --force and only when mha2mla wrote it; the file is written
under a hidden sibling name (short whatever OUT's length), fsynced and renamed. A ``~`` in OUT is the home folder."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.output import (
    check_name_length,
    check_parent,
    first_existing,
    is_within,
    read_only,
    remove_made,
    remove_stale,
    staging_for,
    user_path,
    what_it_is,
    write_errors,
)


def check_file_destination(out: str | Path, inputs: Iterable[tuple[str, str | Path | None]], *, force: bool,
                           is_ours_file, kind: str, name: str = "OUT") -> None:
    """Refuse a file OUT that cannot be written safely, with the folder rules of :func:`check_destination`.

    OUT is never a link, a folder, an input or inside one; it lies in a folder that can be written; an existing OUT
    is replaced only with ``force`` and only when ``is_ours_file(OUT)`` says mha2mla wrote it (``kind`` names it)."""
    check_name_length(out, name)
    shown, out = out, user_path(out)
    if out.is_symlink():
        raise UserError(f"{name} {shown} is a symbolic link; give a new file path.")
    if out.exists() and not out.is_file():
        raise UserError(f"{name} {shown} is {what_it_is(out)}; give the path of the {kind} file to write.")
    target = out.resolve()
    for label, given in inputs:
        if given is None or not user_path(given).exists():
            continue
        path = user_path(given).resolve()
        if is_within(target, path):
            raise UserError(f"{name} {shown} lies inside {label} ({given}); write the {kind} outside it.")
    check_parent(shown, target, name)
    if out.exists():
        if not is_ours_file(out):
            raise UserError(f"{name} {shown} exists and is not a {kind} written by mha2mla; choose another {name} "
                            f"(--force replaces only mha2mla's own {kind} files).")
        if not force:
            raise UserError(f"{name} {shown} holds an earlier mha2mla {kind}; pass --force to replace it or choose another {name}.")
        if read_only(out):
            raise UserError(f"{name} {shown} is read-only; make it writable (chmod u+w) or choose another {name}.")


@contextmanager
def staged_file(out: str | Path) -> Iterator[Path]:
    """A hidden sibling path of ``out`` to write into; on a clean exit it is renamed to ``out`` (atomic on one file
    system) with the user's umask permissions, on any error it is removed with the parent folders made for it.
    Call :func:`check_file_destination` first. A full disk or a permission error is one sentence."""
    out = user_path(out)
    made, staging = staging_for(out)
    try:
        with write_errors(out):
            remove_stale(out.parent)
            yield staging
            with open(staging, "rb+") as handle:
                os.fsync(handle.fileno())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(staging, 0o666 & ~umask)
            if out.is_symlink() or out.is_dir():
                raise UserError(f"OUT {out} became a link or a folder while mha2mla wrote; nothing was replaced.")
            os.replace(staging, out)
    except BaseException:
        if os.path.lexists(staging):
            staging.unlink()
        remove_made(made)
        raise


def check_results_folder(out: str | Path, what: str, *, name: str = "--out") -> None:
    """Refuse a folder that files (``what``) are written into but that cannot hold them: a file, a read-only
    folder, a path under a file or in a folder that cannot be written. Unlike OUT it may exist and be the current
    folder: only the named files in it are replaced."""
    check_name_length(out, name)
    target = user_path(out).resolve()
    if target.exists() and not target.is_dir():
        raise UserError(f"{name} {out} is {what_it_is(target)}; give a folder to write {what} into.")
    existing = first_existing(target)
    if not existing.is_dir():
        raise UserError(f"{existing} is {what_it_is(existing)}, so {name} {out} cannot be created there; choose another {name}.")
    if read_only(existing):
        where = f"{name} {out} is read-only" if existing == target else f"cannot write into {existing} (no write permission)"
        raise UserError(f"{where}; choose a {name} you can write to.")
