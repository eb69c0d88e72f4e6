"""The hidden sibling names mha2mla writes under before an output takes its own name, and the clean-up of what a
killed writer left there (the rules are in mha2mla/io/output.py).

A staging name is ``.NAME.mha2mla-KIND.PID.HOST.XXXXXXXX`` beside NAME: KIND ``tmp`` for the new output being
written, ``old`` for an output moved aside while its replacement is swapped in. Every name must fit the file
system's limit of 255 bytes (NAME_MAX) whatever NAME's own length, so when the full form would not, NAME is cut to
a short prefix followed by ``~`` and a hash of the whole name; an output moved aside under such a name keeps its
own name inside a hidden folder of the short name, so that a killed run's output can still be put back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

log = logging.getLogger(__name__)

NAME_MAX = 255  # bytes in one path component, on every file system mha2mla writes to
_PREFIX_CHARS = 32  # of a name too long to be kept whole in a staging name
_STAGED = re.compile(r"^\.(?P<name>.+)\.mha2mla-(?P<kind>tmp|old)\.(?P<pid>\d+)\.(?P<host>[A-Za-z0-9-]+)\.[0-9a-f]+$")
_SHORTENED = re.compile(r"~(?P<digest>[0-9a-f]{8})$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0]) or "localhost"


def _fits(name: str) -> bool:
    return len(os.fsencode(name)) <= NAME_MAX


def _digest(name: str) -> str:
    return hashlib.sha256(os.fsencode(name)).hexdigest()[:8]


def staging_name(name: str, suffix: str) -> str:
    """``.NAME`` + ``suffix``, or, when that exceeds NAME_MAX, a prefix of NAME, ``~`` and a hash of it instead."""
    if _fits(f".{name}{suffix}"):
        return f".{name}{suffix}"
    prefix = name[:_PREFIX_CHARS]
    while prefix and not _fits(f".{prefix}~{_digest(name)}{suffix}"):
        prefix = prefix[:-1]
    return f".{prefix}~{_digest(name)}{suffix}"


def staging_path(target: Path, kind: str = "tmp") -> Path:
    """A fresh hidden sibling name of ``target`` carrying this process's PID and host (``kind``: tmp or old)."""
    target = Path(target)
    return target.parent / staging_name(target.name, f".mha2mla-{kind}.{os.getpid()}.{_host()}.{secrets.token_hex(4)}")


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a hidden ``old`` staging name (see the module docstring); the path it now has."""
    path = Path(path)
    aside = staging_path(path, "old")
    if aside.name.startswith(f".{path.name}.mha2mla-old."):  # the whole name fits: the usual form
        os.rename(path, aside)
        return aside
    aside.mkdir()  # a hidden folder of the short name keeps the entry under its own name
    try:
        os.rename(path, aside / path.name)
    except BaseException:
        aside.rmdir()
        raise
    return aside / path.name


def _holder(moved: Path, original: Path) -> Path | None:
    """The hidden folder :func:`move_aside` put ``moved`` into, or None when it was renamed in place."""
    return None if moved.parent == original.parent else moved.parent


def put_back(moved: Path, original: Path) -> None:
    """Undo :func:`move_aside`."""
    os.rename(moved, original)
    holder = _holder(moved, original)
    if holder is not None:
        holder.rmdir()


def discard_aside(moved: Path, original: Path) -> None:
    """Delete what :func:`move_aside` moved, with the hidden folder that held it."""
    shutil.rmtree(_holder(moved, original) or moved, ignore_errors=True)


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


def _moved_entry(path: Path, name: str) -> tuple[Path, Path]:
    """(where a moved-aside entry is, the name it goes back to) for an ``old`` staging entry ``path``."""
    shortened = _SHORTENED.search(name)
    if shortened and path.is_dir() and not path.is_symlink():
        inside = list(path.iterdir())
        if len(inside) == 1 and _digest(inside[0].name) == shortened["digest"]:
            return inside[0], path.parent / inside[0].name
    return path, path.parent / name


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
        if match["kind"] == "old":
            moved, original = _moved_entry(path, match["name"])
            if not os.path.lexists(original):
                put_back(moved, original)
                log.warning("put %s back: a killed run had moved it aside", original)
                continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.info("removed %s, left by a run that was killed", path)
