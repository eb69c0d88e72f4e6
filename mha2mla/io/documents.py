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
skipped). A text file is one document (locator 0); mha2mla.io.pieces reads it in pieces of bounded size, for
streaming.

Every problem with the input is a :class:`mha2mla.UserError` of one sentence that names the file (and the line or
record). A missing path or a folder without readable files is reported when ``iter_documents`` is called; the rest
when the reader reaches the file or record concerned.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import NOT_REGULAR

PLAIN_SUFFIXES = (".txt", ".md", ".rst")
TEXT_SUFFIXES = (*PLAIN_SUFFIXES, ".jsonl", ".json", ".parquet")
TEXT_FIELDS = ("text", "content", "document", "body")
DEFAULT_SPLIT = "train"

_SUFFIX_LIST = "/".join(TEXT_SUFFIXES)
_JSON_TYPES = {list: "an array", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}


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
    documents = _located_in_file(Path(unit), text_field, start) if local else _located_in_dataset(unit, text_field, start)
    count = 0
    for located in documents:
        if located[1].strip():
            count += 1
            yield located
    if count == 0 and start is None:
        what = f"{Path(unit)} is empty (it holds no non-blank text); remove it or give it some text." if local else (
            f"dataset {unit} holds no non-blank text; check the config, the split and the text field.")
        raise UserError(what)


def is_local(spec: str) -> bool:
    """True when ``spec`` names a local path (existing, or shaped like one) rather than a dataset id."""
    path = Path(spec).expanduser()
    return path.exists() or path.suffix.lower() in TEXT_SUFFIXES or spec.startswith((".", "/", "~"))


def resolve_files(spec: str) -> list[Path]:
    """The readable files of ``spec``: the file itself, or every readable file under the folder (sorted, recursive)."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{spec} does not exist; give a {_SUFFIX_LIST} file, a folder of them, or a Hugging Face dataset id.")
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise UserError(f"{path} is not a {_SUFFIX_LIST} file; convert it to one of those or give a folder of them.")
        return [path]
    if not path.is_dir():
        raise UserError(f"{path} is {NOT_REGULAR}; give a {_SUFFIX_LIST} "
                        "file, a folder of them, or a Hugging Face dataset id.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise UserError(f"folder {path} holds no {_SUFFIX_LIST} files; add some or point at another folder.")
    return files


def _located_in_file(path: Path, text_field: str | None, start: object) -> Iterator[tuple[object, str]]:
    suffix = path.suffix.lower()
    if suffix in PLAIN_SUFFIXES:
        yield 0, read_text(path)
    elif suffix == ".jsonl" or (suffix == ".json" and isinstance(start, list)):
        yield from _located_in_json_lines(path, text_field, start)
    elif suffix == ".json":
        yield from _located_in_json(path, read_text(path), text_field, start or 0)
    else:
        yield from _located_in_parquet(path, text_field, start or [0, 0])


# ------------------------------------------------------------------------------------------------ text and JSON


def decoded(path: Path, data: bytes, offset: int) -> str:
    """``data`` (read at byte ``offset`` of ``path``) as UTF-8; NUL bytes (binary data, UTF-16) or bytes that are not
    UTF-8 are a UserError naming the file offset."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise UserError(f"{path} is not UTF-8 text (NUL byte at offset {offset + nul}); give a text file encoded as UTF-8.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {offset + error.start}); re-encode it as "
                        "UTF-8.") from None


def read_text(path: Path) -> str:
    """The UTF-8 text of a file (a leading byte-order mark dropped); NUL bytes or bytes that are not UTF-8 are a
    UserError."""
    data = path.read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    return decoded(path, data[bom:], bom)


def _located_in_json_lines(path: Path, text_field: str | None, start: list | None) -> Iterator[tuple[list, str]]:
    """Line by line from byte ``start[0]`` (line ``start[1]``): memory holds one line, never the file."""
    offset, line_number = start or (0, 1)
    with path.open("rb") as handle:
        handle.seek(offset)
        if offset == 0 and handle.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
            handle.seek(0)
        offset = handle.tell()
        # lines end at b"\n" only: U+2028 and friends, which JSON strings may hold, are no line ends
        for raw in handle:
            line = decoded(path, raw, offset)
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UserError(f"{path}:{line_number} is not valid JSON ({error.msg}); each line of a JSON-lines "
                                    "file must hold one string or object.") from None
                yield [offset, line_number], record_text(record, text_field, f"{path}:{line_number}")
            offset += len(raw)
            line_number += 1


def _located_in_json(path: Path, text: str, text_field: str | None, start: int) -> Iterator[tuple[object, str]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # several values, one a line: JSON lines under a .json name
            yield from _located_in_json_lines(path, text_field, None)
            return
        raise UserError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}).") from None
    if isinstance(data, list):
        for index in range(start, len(data)):
            yield index, record_text(data[index], text_field, f"{path} item {index}")
    else:
        yield 0, record_text(data, text_field, str(path))


def record_text(record: object, text_field: str | None, where: str) -> str:
    """The text of one record: a string is the text; an object gives ``text_field``, else the first text field."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        kind = _JSON_TYPES.get(type(record), type(record).__name__)
        raise UserError(f"{where} is {kind}, not a string or an object with a text field; give one document per record.")
    if text_field is not None:
        value = record.get(text_field)
        if not isinstance(value, str):
            raise UserError(f"{where} has no string field {text_field!r}; name the field that holds the text.")
        return value
    for name in TEXT_FIELDS:
        value = record.get(name)
        if isinstance(value, str):
            return value
    raise UserError(f"{where} has no string field among {', '.join(TEXT_FIELDS)}; add one or name the field that holds "
                    "the text.")


# ------------------------------------------------------------------------------------------------ parquet


def _located_in_parquet(path: Path, text_field: str | None, start: list) -> Iterator[tuple[list, str]]:
    """Row group by row group from row ``start[1]`` of group ``start[0]``: memory holds one batch of rows."""
    try:  # optional dependency (the mha2mla[parquet] extra), only needed for .parquet files
        import pyarrow.parquet as pq
        import pyarrow.types as pa_types
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow; `pip install pyarrow` or give .txt/.jsonl files.") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own error types for files that are not parquet
        raise UserError(f"{path} is not a readable parquet file ({_first_line(error)}).") from None
    schema = parquet.schema_arrow
    textual = [f.name for f in schema if pa_types.is_string(f.type) or pa_types.is_large_string(f.type)]
    if text_field is not None:
        if text_field not in textual:
            raise UserError(f"{path} has no string column {text_field!r}; name the column that holds the text.")
        column = text_field
    else:
        column = next((name for name in TEXT_FIELDS if name in textual), None)
        if column is None:
            raise UserError(f"{path} has no string column among {', '.join(TEXT_FIELDS)}; name the column that holds "
                            "the text.")
    first_group, first_row = start
    for group in range(first_group, parquet.num_row_groups):
        row = 0
        for batch in parquet.iter_batches(columns=[column], batch_size=1024, row_groups=[group]):
            for value in batch.column(0).to_pylist():
                if value is not None and (group, row) >= (first_group, first_row):  # a null cell is a row without text
                    yield [group, row], value
                row += 1


# ------------------------------------------------------------------------------------------------ Hugging Face datasets


def parse_dataset_id(spec: str) -> tuple[str, str | None, str]:
    """``name[:config][@split]`` -> (name, config or None, split)."""
    head, at, split = spec.partition("@")
    name, colon, config = head.partition(":")
    if not name or (at and not split) or (colon and not config):
        raise UserError(f"{spec!r} is not a dataset id; write name, name:config, name@split or name:config@split.")
    return name, config or None, split or DEFAULT_SPLIT


def _located_in_dataset(spec: str, text_field: str | None, start: object) -> Iterator[tuple[object, str]]:
    """Records in the dataset's order from ``start``: [record index, the streamed dataset's state before it] (its
    ``state_dict()``: shards before it are not read again), or an index alone (the records before it streamed past)."""
    name, config, split = parse_dataset_id(spec)
    try:  # optional and slow to import: only loaded when a dataset id is read
        from datasets import IterableDataset, load_dataset
    except ImportError:
        raise UserError(f"reading the dataset {spec} needs the `datasets` package; `pip install datasets` or give "
                        "local files.") from None
    index, state = start if isinstance(start, list) else (start or 0, None)
    try:
        dataset = load_dataset(name, config, split=split, streaming=True)
        resumable = isinstance(dataset, IterableDataset)
        if resumable and state is not None:
            dataset.load_state_dict(state)
        records = iter(dataset) if resumable and state is not None else islice(iter(dataset), index, None)
    except Exception as error:  # datasets raises many error types (not found, offline, bad config)
        raise _not_loadable(spec, error) from None
    while True:
        where = [index, dataset.state_dict()] if resumable else index
        try:
            record = next(records)
        except StopIteration:
            break
        except Exception as error:  # a network failure half-way through the stream
            raise _not_loadable(spec, error) from None
        yield where, record_text(record, text_field, f"dataset {spec} record {index}")
        index += 1


def _not_loadable(spec: str, error: Exception) -> UserError:
    return UserError(f"{spec} is neither an existing file or folder nor a loadable Hugging Face dataset "
                     f"({type(error).__name__}: {_first_line(error)[:200]}); check the path, or the dataset id and network.")


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


__all__ = ["PLAIN_SUFFIXES", "TEXT_FIELDS", "TEXT_SUFFIXES", "decoded", "is_local", "iter_documents", "iter_located",
           "parse_dataset_id", "read_text", "record_text", "resolve_files", "units"]
