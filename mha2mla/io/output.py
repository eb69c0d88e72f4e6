"""Where mha2mla writes a model folder, and how, so that a user's files are never lost.

The one implementation behind every output folder: ``convert``'s OUT (mha2mla/convert/pipeline.py) and
``recover``'s --out (mha2mla/train/merge.py); the GGUF cache (mha2mla/io/source.py) uses its staging names.

- OUT is never a symbolic link or a file, never an input (the source model, or a folder holding it), never the
  current folder or one above it, and it lies in a folder that can be written. A folder the user made read-only
  (no write bit, even for root) is left alone.
- An existing OUT is replaced only when it is empty, or, with --force, when mha2mla wrote it: it holds one of
  :data:`MARKERS` (every output folder gets one) and nothing else than what mha2mla wrote there: the names its
  list in mha2mla/io/written.py (written into every output folder), a recover run's checkpoints and logs, and, for a folder
  written before manifests existed, the file names a conversion writes. A folder holding anything else (the user's
  notes, a results folder) is refused with the names, --force or not, so no user file is ever deleted.
- The new folder is written next to OUT under a hidden name carrying the writer's PID and host
  (``.OUT.mha2mla-tmp.PID.HOST.XXXXXXXX``) and swapped in at the end: the old OUT is moved aside
  (``.OUT.mha2mla-old.…``), the new one renamed to OUT, then the old one deleted. An error or Ctrl-C removes the new
  folder. What a killed writer left is removed by the next run that writes next to it (a moved-aside OUT whose
  replacement never arrived is put back instead).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.written import MANIFEST, foreign_entries, is_ours, write_manifest

log = logging.getLogger(__name__)

_STAGED = re.compile(r"^\.(?P<name>.+)\.mha2mla-(?P<kind>tmp|old)\.(?P<pid>\d+)\.(?P<host>[A-Za-z0-9-]+)\.[0-9a-f]+$")
_WRITE_HINTS = {
    errno.ENOSPC: "free some space or write to another disk",
    errno.EDQUOT: "free some space or write to another disk",
    errno.EROFS: "write to a writable file system",
    errno.EACCES: "fix the permissions or write elsewhere",
    errno.EPERM: "fix the permissions or write elsewhere",
}


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0]) or "localhost"


def staging_path(target: Path, kind: str = "tmp") -> Path:
    """A fresh hidden sibling name of ``target`` carrying this process's PID and host (``kind``: tmp or old)."""
    return target.parent / f".{target.name}.mha2mla-{kind}.{os.getpid()}.{_host()}.{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    if os.name != "posix":  # no cheap, safe liveness probe: never clean
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(folder: Path) -> None:
    """Remove the staging folders in ``folder`` whose writer (on this host) is no longer running; a moved-aside
    folder whose replacement never arrived goes back to its name."""
    try:
        entries = sorted(Path(folder).iterdir(), key=lambda path: ".mha2mla-old." not in path.name)
    except OSError:
        return
    for path in entries:
        match = _STAGED.match(path.name)
        if not match or match["host"] != _host() or _alive(int(match["pid"])):
            continue
        original = path.parent / match["name"]
        if match["kind"] == "old" and not os.path.lexists(original):
            os.rename(path, original)
            log.warning("put %s back: a killed run had moved it aside", original)
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.info("removed %s, left by a run that was killed", path)


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
        raise UserError(f"{parent} is a file, so {name} {out} cannot be created there; choose another {name}.")
    if read_only(parent):
        raise UserError(f"cannot write into {parent} (no write permission); choose an {name} in a folder you can write to.")


def check_destination(out: str | Path, inputs: Iterable[tuple[str, str | Path | None]] = (), *, name: str = "OUT") -> None:
    """Refuse an OUT that can never be written safely. ``inputs``: (label, path) pairs of what the command reads."""
    out = Path(out)
    if out.is_symlink():
        raise UserError(f"{name} {out} is a symbolic link; give the folder it points to ({os.readlink(out)}) or a new path.")
    target = out.expanduser().resolve()
    _check_inputs(out, target, inputs, name)
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current folder was deleted
        cwd = None
    if cwd is not None and is_within(cwd, target):
        raise UserError(f"{name} {out} is the current folder or one above it; give a new folder, e.g. ./{target.name or 'model'}-mla.")
    if out.exists() and not out.is_dir():
        raise UserError(f"{name} {out} is a file; give a folder path.")
    if out.is_dir() and read_only(out):
        raise UserError(f"{name} {out} is read-only; make it writable (chmod u+w) or choose another {name}.")
    check_parent(out, target, name)


def check_replaceable(out: str | Path, force: bool, *, name: str = "OUT", carry: bool = False) -> None:
    """An existing non-empty OUT may be replaced only with ``force``, only when mha2mla wrote it and only when it
    holds nothing mha2mla did not write (``carry``: its entries move into the new folder, so none is lost)."""
    out = Path(out)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not is_ours(out):
        hint = " (--force replaces only mha2mla's own output folders)" if name == "OUT" else ""
        raise UserError(f"{name} {out} is not empty and was not written by mha2mla; choose another {name}{hint}.")
    foreign = [] if carry else foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"{name} {out} is an earlier mha2mla output but also holds files mha2mla did not write "
                        f"({shown}); move them out or choose another {name}: nothing of yours is ever replaced.")
    if not force:
        raise UserError(f"{name} {out} holds an earlier mha2mla output; pass --force to replace it or choose another {name}.")


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


def _swap(new: Path, out: Path, carry: bool, name: str) -> None:
    """Put ``new`` in place of ``out``: old moved aside, new renamed, old deleted; undone if a rename fails."""
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    moved = _carry_over(out, new, name) if carry else []
    aside = staging_path(out, "old")
    try:
        os.rename(out, aside)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(aside, out)
            raise
    except BaseException:
        for entry in moved:
            os.replace(new / entry, out / entry)
        raise
    shutil.rmtree(aside, ignore_errors=True)


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
def staged_output(out: str | Path, *, force: bool = False, carry: bool = False, name: str = "OUT") -> Iterator[Path]:
    """An empty folder next to ``out`` to write the new output into; on a clean exit it replaces ``out`` (see the
    module docstring), on an error it is removed with any parent folders made for it. ``carry``: the entries of an
    existing ``out`` (a recover run folder) move into the new folder. Call :func:`check_destination` first."""
    out = Path(out)
    made, staging = staging_for(out)
    try:
        with write_errors(out):
            remove_stale(out.parent)
            staging.mkdir()
            yield staging
            if out.is_symlink():
                raise UserError(f"{name} {out} became a symbolic link while mha2mla wrote; nothing was replaced.")
            check_replaceable(out, force or carry, name=name, carry=carry)  # again: OUT may have changed meanwhile
            write_manifest(staging)
            _normal_permissions(staging)
            _swap(staging, out, carry, name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_made(made)
        raise
