"""Where mha2mla writes a model folder, and how, so that a user's files are never lost.

The one implementation behind every output folder: ``convert``'s OUT (mha2mla/convert/pipeline.py) and
``recover``'s --out (mha2mla/train/model/merge.py); the GGUF cache (mha2mla/io/source.py) uses its staging names
(mha2mla/io/staging.py). A ``~`` in OUT is the home folder, for the checks and the writing alike.

- OUT is never a symbolic link or a file, never an input (the source model, or a folder holding it), never the
  current folder or one above it, and it lies in a folder that can be written. A folder the user made read-only
  (no write bit, even for root) is left alone. A name longer than the file system allows is one sentence.
- An existing OUT is replaced only when it is empty, or, with --force, when mha2mla wrote it: it holds one of
  its markers and its list of what it wrote there (mha2mla/io/written.py), and nothing else: no entry the list
  does not name, no listed file changed since (a model card edited by hand), no recover checkpoints (a run that
  can still resume). Such a folder is refused with the names, --force or not, so no user file is ever deleted.
- The new folder is written next to OUT under a hidden name carrying the writer's PID and host
  (``.OUT.mha2mla-tmp.PID.HOST.XXXXXXXX``, shortened with a hash when OUT's name is long) and swapped in at the
  end: the old OUT is moved aside (``.OUT.mha2mla-old.…``), the new one renamed to OUT, then the old one deleted.
  An error or Ctrl-C removes the new folder. What a killed writer left is removed by the next run that writes next
  to it (a moved-aside OUT whose replacement never arrived is put back instead).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import CARD_FILE, NOT_REGULAR
from mha2mla.io.staging import NAME_MAX, discard_aside, move_aside, put_back, remove_stale, staging_path
from mha2mla.io.written import (
    MANIFEST,
    changed_entries,
    checkpoint_entries,
    foreign_entries,
    is_ours,
    record_written,
    write_manifest,
    written_names,
)

_WRITE_HINTS = {
    errno.ENOSPC: "free some space or write to another disk",
    errno.EDQUOT: "free some space or write to another disk",
    errno.EROFS: "write to a writable file system",
    errno.EACCES: "fix the permissions or write elsewhere",
    errno.EPERM: "fix the permissions or write elsewhere",
    errno.ENAMETOOLONG: "choose a shorter path",
}


def user_path(path: str | Path) -> Path:
    """A path as the user meant it: ``~`` is the home folder (also when the shell did not expand it, quoted)."""
    return Path(path).expanduser()


def what_it_is(path: Path) -> str:
    """What an existing ``path`` is, as the end of "X is ...": a file, a folder or something else."""
    if path.is_dir():
        return "a folder"
    if path.is_file():
        return "a file"
    return NOT_REGULAR


def check_name_length(out: str | Path, name: str = "OUT") -> None:
    """Refuse a path with a name longer than the file system allows (NAME_MAX bytes), before anything looks at it."""
    for part in user_path(out).parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            shown = part if len(part) <= 40 else part[:37] + "..."
            raise UserError(f"the name {shown} in {name} is {size} bytes long, longer than the {NAME_MAX} bytes a "
                            f"file system allows; choose a shorter {name}.")


def first_existing(target: Path) -> Path:
    """``target`` or its nearest ancestor that exists."""
    parent = target
    while not parent.exists():
        parent = parent.parent
    return parent


def read_only(path: Path) -> bool:
    """No write permission, or no write bit at all (what a user means by read-only, also when running as root)."""
    return not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222


def is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_inputs(out: Path, target: Path, inputs: Iterable[tuple[str, str | Path | None]], name: str) -> None:
    for label, given in inputs:
        if given is None or not Path(given).expanduser().exists():  # a hub or dataset id: nothing local to protect
            continue
        path = Path(given).expanduser().resolve()
        if path == target:
            raise UserError(f"{name} {out} is {label} itself; choose another {name}: mha2mla never writes over its input.")
        if target in path.parents:
            raise UserError(f"{name} {out} holds {label} ({given}); choose an {name} outside it.")
        if path.is_dir() and path in target.parents:
            raise UserError(f"{name} {out} lies inside {label} ({given}); choose an {name} outside it.")


def check_parent(out: Path, target: Path, name: str) -> None:
    """Refuse an ``out`` whose nearest existing ancestor is a file or cannot be written."""
    parent = first_existing(target.parent)
    if not parent.is_dir():
        raise UserError(f"{parent} is {what_it_is(parent)}, so {name} {out} cannot be created there; choose another {name}.")
    if read_only(parent):
        raise UserError(f"cannot write into {parent} (no write permission); choose an {name} in a folder you can write to.")


def check_destination(out: str | Path, inputs: Iterable[tuple[str, str | Path | None]] = (), *, name: str = "OUT") -> None:
    """Refuse an OUT that can never be written safely. ``inputs``: (label, path) pairs of what the command reads."""
    check_name_length(out, name)
    shown, out = out, user_path(out)
    if out.is_symlink():
        raise UserError(f"{name} {shown} is a symbolic link; give the folder it points to ({os.readlink(out)}) or a new path.")
    target = out.resolve()
    _check_inputs(shown, target, inputs, name)
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current folder was deleted
        cwd = None
    if cwd is not None and is_within(cwd, target):
        raise UserError(f"{name} {shown} is the current folder or one above it; give a new folder, e.g. ./{target.name or 'model'}-mla.")
    if out.exists() and not out.is_dir():
        raise UserError(f"{name} {shown} is {what_it_is(out)}; give a folder path.")
    if out.is_dir() and read_only(out):
        raise UserError(f"{name} {shown} is read-only; make it writable (chmod u+w) or choose another {name}.")
    check_parent(shown, target, name)


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_replaceable(out: str | Path, force: bool, *, name: str = "OUT", carry: bool = False) -> None:
    """An existing non-empty OUT may be replaced only with ``force``, only when mha2mla wrote it and only when all
    it holds is what mha2mla's list there names, unchanged, and no recover checkpoints (``carry``: its entries
    move into the new folder, so none is lost and the list is not needed)."""
    shown, out = out, user_path(out)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not is_ours(out):
        hint = " (--force replaces only mha2mla's own output folders)" if name == "OUT" else ""
        raise UserError(f"{name} {shown} is not empty and was not written by mha2mla; choose another {name}{hint}.")
    if carry:
        return
    if written_names(out) is None:
        raise UserError(f"{name} {shown} is an mha2mla output without its list of what mha2mla wrote ({MANIFEST}), "
                        f"so nothing in it can be told from your files; delete it by hand or choose another {name}.")
    checkpoints = checkpoint_entries(out)
    if checkpoints:
        raise UserError(f"{name} {shown} holds the checkpoints of a recover run ({_listing(checkpoints)}), which "
                        f"--force never deletes; finish the run with --resume auto, or move them away or delete them "
                        f"by hand, or choose another {name}.")
    foreign = foreign_entries(out)
    if foreign:
        raise UserError(f"{name} {shown} is an earlier mha2mla output but also holds files mha2mla did not write "
                        f"({_listing(foreign)}); move them out or choose another {name}: nothing of yours is ever replaced.")
    changed = changed_entries(out)
    if changed:
        what = ("the model card mha2mla wrote (README.md), edited since" if changed == [CARD_FILE] else
                f"files changed since mha2mla wrote them ({_listing(changed)})")
        them = "it" if len(changed) == 1 else "them"
        raise UserError(f"{name} {shown} holds {what}; move {them} away or delete {them} by hand, or choose another "
                        f"{name}: nothing of yours is ever replaced.")
    if not force:
        raise UserError(f"{name} {shown} holds an earlier mha2mla output; pass --force to replace it or choose another {name}.")


def _normal_permissions(folder: Path) -> None:
    """The permissions of a folder the user makes: copied files (tokenizer) lose read-only or private modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _carry_over(old: Path, new: Path, name: str) -> list[str]:
    """Move the entries of ``old`` (a recover run folder: checkpoints, logs) into ``new``; refuse a clash."""
    entries = sorted(entry for entry in old.iterdir() if entry.name != MANIFEST)  # the new folder lists its own
    clash = next((entry.name for entry in entries if os.path.lexists(new / entry.name)), None)
    if clash is not None:
        raise UserError(f"{name} {old} holds {clash}, which the new model would overwrite; move it away and run again.")
    for entry in entries:
        os.replace(entry, new / entry.name)
    return [entry.name for entry in entries]


def _swap(new: Path, out: Path, carry: dict[str, str | None] | None, name: str) -> None:
    """Put ``new`` in place of ``out``: old moved aside, new renamed, old deleted; undone if a rename fails.
    ``carry``: the entries of ``out`` move into ``new`` first, those named (mha2mla's: name -> hash) listed there."""
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    moved = _carry_over(out, new, name) if carry is not None else []
    try:
        record_written(new, {entry: carry[entry] for entry in moved if entry in carry})
        aside = move_aside(out)
        try:
            os.rename(new, out)
        except BaseException:
            put_back(aside, out)
            raise
    except BaseException:
        for entry in moved:
            os.replace(new / entry, out / entry)
        raise
    discard_aside(aside, out)


def remove_made(made: list[Path]) -> None:
    """Remove the folders :func:`make_parents` made (innermost first) while they are empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            break


def make_parents(folder: Path) -> list[Path]:
    """mkdir -p ``folder``; the folders it made, outermost first."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


# Writers that lose the errno: safetensors ("... (os error 28)"), numpy's tofile under the gguf package ("N
# requested and M written", "Not enough free space to write ...").
_OS_ERROR_CODE = re.compile(r"os error (\d+)")
_SHORT_WRITE = re.compile(r"Not enough free space|requested and \d+ written")


def write_errno(error: BaseException) -> int | None:
    """The errno behind a failed write, also when a library wrapped it in its own exception or message."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    match = _OS_ERROR_CODE.search(str(error))
    if match:
        return int(match[1])
    if isinstance(error, OSError) and _SHORT_WRITE.search(str(error)):
        return errno.ENOSPC
    return None


@contextmanager
def write_errors(out: Path) -> Iterator[None]:
    """A full disk or a permission error while writing is one sentence, not a traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        code = write_errno(error)
        if code not in _WRITE_HINTS:
            raise
        where = getattr(error, "filename", None) or out
        raise UserError(f"could not write {where} ({os.strerror(code)}); {_WRITE_HINTS[code]}.") from error


def staging_for(out: Path) -> tuple[list[Path], Path]:
    """The parent folders made for ``out`` (to remove on failure) and a fresh staging name next to it."""
    with write_errors(out):
        made = make_parents(out.parent)
    return made, staging_path(out)


@contextmanager
def staged_output(out: str | Path, *, force: bool = False, carry: bool = False, name: str = "OUT",
                  own: Iterable[str] = ()) -> Iterator[Path]:
    """An empty folder next to ``out`` to write the new output into; on a clean exit it replaces ``out`` (see the
    module docstring), on an error it is removed with any parent folders made for it. ``carry``: the entries of an
    existing ``out`` (a recover run folder) move into the new folder; those its list names, and ``own`` (what the
    caller wrote there itself), stay on the list. Call :func:`check_destination` first."""
    shown, out = out, user_path(out)
    made, staging = staging_for(out)
    try:
        with write_errors(out):
            remove_stale(out.parent)
            staging.mkdir()
            yield staging
            if out.is_symlink():
                raise UserError(f"{name} {shown} became a symbolic link while mha2mla wrote; nothing was replaced.")
            check_replaceable(out, force or carry, name=name, carry=carry)  # again: OUT may have changed meanwhile
            kept = {**dict.fromkeys(own), **(written_names(out) or {})} if carry else None
            write_manifest(staging)
            _normal_permissions(staging)
            _swap(staging, out, kept, name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_made(made)
        raise
