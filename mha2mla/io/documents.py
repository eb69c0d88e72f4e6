"""The one reader of text documents, for calibration text (docs/calibration.md) and recovery data (docs/recover.md).

``iter_documents(spec, text_field=None)`` yields the documents of ``spec``, which is one of

- a plain text file (``.txt``, ``.md``, ``.rst``): the whole file is one document;
- a JSON-lines file (``.jsonl``): one record per non-blank line;
- a JSON file (``.json``): a list of records, or one record (a file that holds several JSON values, one a line,
  is read as JSON lines);
- a ``.parquet`` file (needs pyarrow): one record per row;
- a folder: every file above found under it, recursively, in sorted path order (other files are skipped);
- a Hugging Face dataset id, streamed with ``datasets``: ``name``, ``name:config``, ``name@split`` or
  ``name:config@split`` (split ``train`` unless given).

A record is a JSON string (the document itself) or an object whose text is the field ``text_field`` when given,
else the first of ``text``, ``content``, ``document``, ``body`` that holds a string (a parquet file: the first of
those columns holding strings). Documents that are empty or only whitespace are skipped; a file that yields
none is an error. Files must be UTF-8 (a leading byte-order mark is dropped).

``units(spec)`` lists what a spec reads, in order (its files, or the dataset id itself), and
``iter_located(unit, text_field, start)`` yields ``(locator, document)`` pairs of one of them, where a locator is a
small JSON-able position a later call resumes at without reading what comes before, where the format allows: a
JSON-lines file's byte offset (and line number), a parquet file's row group and row, a JSON file's item index
(the file is parsed again), a dataset's record index and streaming state (``datasets``' own: shards before it are
skipped). A text file is one document (locator 0); ``iter_pieces(unit, text_field, start)`` reads it in pieces of
bounded size, for streaming (mha2mla.io.text_formats), and a record of the other formats as one piece.

Every problem with the input is a :class:`mha2mla.UserError` of one sentence that names the file (and the line or
record). A missing path or a folder without readable files is reported when ``iter_documents`` is called; the rest
when the reader reaches the file or record concerned.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import NOT_REGULAR
from mha2mla.io.text_formats import (
    PLAIN_SUFFIXES,
    SUFFIX_LIST,
    TEXT_SUFFIXES,
    Piece,
    located_in_dataset,
    located_in_file,
    text_pieces,
)

DEFAULT_SPLIT = "train"


def iter_documents(spec: str, text_field: str | None = None) -> Iterator[str]:
    """The documents of one file, folder or Hugging Face dataset id, in order (see the module docstring)."""
    return (text for unit in units(spec) for _, text in iter_located(unit, text_field))


def units(spec: str) -> list[str]:
    """What ``spec`` reads, in order: its files (a missing path or an empty folder is an error now), or the dataset
    id itself (checked for its syntax)."""
    if is_local(spec):
        return [str(path) for path in resolve_files(spec)]
    parse_dataset_id(spec)
    return [spec]


def iter_located(unit: str, text_field: str | None = None, start: object = None) -> Iterator[tuple[object, str]]:
    """``(locator, document)`` of one file or dataset id from the document at ``start`` (a locator this function
    yielded; None: the beginning). Blank documents are skipped; a unit read from its beginning that yields none is
    an error."""
    local = is_local(unit)
    if local:
        documents = located_in_file(Path(unit), text_field, start)
    else:
        documents = located_in_dataset(unit, parse_dataset_id(unit), text_field, start)
    count = 0
    for located in documents:
        if located[1].strip():
            count += 1
            yield located
    if count == 0 and start is None:
        what = f"{Path(unit)} is empty (it holds no non-blank text); remove it or give it some text." if local else (
            f"dataset {unit} holds no non-blank text; check the config, the split and the text field.")
        raise UserError(what)


def iter_pieces(unit: str, text_field: str | None = None, start: object = None) -> Iterator[Piece]:
    """The pieces of one unit (a file or dataset id of ``units``) from the piece at ``start`` (a locator this function
    yielded; None: the beginning), for streaming: a record is one piece, a plain text file is read in pieces of
    bounded size (mha2mla.io.text_formats). Blank documents are skipped and a unit without text is an error, as
    ``iter_located`` says; a blank piece inside a longer text is part of it and is kept."""
    if not (is_local(unit) and Path(unit).suffix.lower() in PLAIN_SUFFIXES):
        for locator, text in iter_located(unit, text_field, start):
            yield Piece(locator, text, True, True)
        return
    yield from text_pieces(Path(unit), start)


def is_local(spec: str) -> bool:
    """True when ``spec`` names a local path (existing, or shaped like one) rather than a dataset id."""
    path = Path(spec).expanduser()
    return path.exists() or path.suffix.lower() in TEXT_SUFFIXES or spec.startswith((".", "/", "~"))


def resolve_files(spec: str) -> list[Path]:
    """The readable files of ``spec``: the file itself, or every readable file under the folder (sorted, recursive)."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{spec} does not exist; give a {SUFFIX_LIST} file, a folder of them, or a Hugging Face dataset id.")
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise UserError(f"{path} is not a {SUFFIX_LIST} file; convert it to one of those or give a folder of them.")
        return [path]
    if not path.is_dir():
        raise UserError(f"{path} is {NOT_REGULAR}; give a {SUFFIX_LIST} "
                        "file, a folder of them, or a Hugging Face dataset id.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise UserError(f"folder {path} holds no {SUFFIX_LIST} files; add some or point at another folder.")
    return files


def parse_dataset_id(spec: str) -> tuple[str, str | None, str]:
    """``name[:config][@split]`` -> (name, config or None, split)."""
    head, at, split = spec.partition("@")
    name, colon, config = head.partition(":")
    if not name or (at and not split) or (colon and not config):
        raise UserError(f"{spec!r} is not a dataset id; write name, name:config, name@split or name:config@split.")
    return name, config or None, split or DEFAULT_SPLIT


__all__ = ["PLAIN_SUFFIXES", "TEXT_SUFFIXES", "is_local", "iter_documents", "iter_located",
           "iter_pieces", "parse_dataset_id", "resolve_files", "units"]
