"""The readers of each text format that mha2mla.io.documents takes (its docstring lists them and what a record is):
a plain text file (``.txt``, ``.md``, ``.rst``), JSON lines, JSON, parquet and a Hugging Face dataset streamed with
``datasets``. ``located_in_file`` and ``located_in_dataset`` yield ``(locator, document)`` pairs, the locator being
where a later read resumes without reading what comes before.

A plain text file is read whole (``read_text``, a leading byte-order mark dropped) or, for streaming one document
however long, in pieces of bounded size (``text_pieces``): ``PIECE_BYTES`` at a time, cut at whitespace, so that
memory holds one piece, never the file. A ``Piece(locator, text, first, last)`` is a document or part of one: where
a later read resumes at that piece (a text file's byte offset; a record's locator), its text, and whether it starts
and ends its document. Concatenated, the pieces of a text file are its text. A full window is cut before its last
whitespace byte that stands between two bytes that are not whitespace (a word or line boundary, where byte-level BPE
tokenizers split the whole text as well), else after its last whitespace byte, else before its last character: the
cut depends only on the bytes from the piece's start, so reading from any piece's locator gives the same pieces
again. Bytes that are not UTF-8 (or NUL bytes: binary data, UTF-16) are a UserError naming the file offset."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import NamedTuple

from mha2mla import UserError

PLAIN_SUFFIXES = (".txt", ".md", ".rst")
TEXT_SUFFIXES = (*PLAIN_SUFFIXES, ".jsonl", ".json", ".parquet")
TEXT_FIELDS = ("text", "content", "document", "body")

SUFFIX_LIST = "/".join(TEXT_SUFFIXES)
_JSON_TYPES = {list: "an array", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}
PIECE_BYTES = 1 << 16
_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")


class Piece(NamedTuple):
    """A document or part of one (module docstring)."""

    locator: object
    text: str
    first: bool
    last: bool


def text_pieces(path: Path, start: int | None) -> Iterator[Piece]:
    """A text file from byte ``start`` (a piece's start), ``PIECE_BYTES`` at a time, each window cut by ``cut``."""
    position, first, text_seen = start or 0, not start, False
    with path.open("rb") as handle:
        if position == 0 and handle.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8:
            position = len(codecs.BOM_UTF8)
        locator = start or 0
        while True:
            handle.seek(position)
            data = handle.read(PIECE_BYTES + 1)
            last = len(data) <= PIECE_BYTES
            end = len(data) if last else cut(data[:PIECE_BYTES])
            text = decoded(path, data[:end], position)
            text_seen = text_seen or bool(text.strip())
            if text_seen or not (first and last):  # a whole document that is blank is skipped
                yield Piece(locator, text, first, last)
            if last:
                break
            position += end
            locator, first = position, False
    if not text_seen and not start:
        raise UserError(f"{path} is empty (it holds no non-blank text); remove it or give it some text.")


def cut(window: bytes) -> int:
    """Where a full window of a text file ends (module docstring): a byte offset above 0."""
    end = len(window)
    while (at := max(window.rfind(b" ", 1, end), window.rfind(b"\n", 1, end))) > 0:
        if window[at - 1] not in _WHITESPACE and at + 1 < len(window) and window[at + 1] not in _WHITESPACE:
            return at
        end = at
    at = max(window.rfind(bytes((byte,))) for byte in _WHITESPACE)
    if at >= 0:
        return at + 1
    at = len(window) - 1
    while at > 0 and 0x80 <= window[at] < 0xC0:  # a UTF-8 continuation byte: the character starts before it
        at -= 1
    return max(at, 1)


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


# ------------------------------------------------------------------------------------------------ records


def located_in_file(path: Path, text_field: str | None, start: object) -> Iterator[tuple[object, str]]:
    """``(locator, document)`` of one file, by its suffix, from the document at ``start`` (None: the beginning)."""
    suffix = path.suffix.lower()
    if suffix in PLAIN_SUFFIXES:
        yield 0, read_text(path)
    elif suffix == ".jsonl" or (suffix == ".json" and isinstance(start, list)):
        yield from _located_in_json_lines(path, text_field, start)
    elif suffix == ".json":
        yield from _located_in_json(path, read_text(path), text_field, start or 0)
    else:
        yield from _located_in_parquet(path, text_field, start or [0, 0])


# ------------------------------------------------------------------------------------------------ JSON


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


def located_in_dataset(spec: str, dataset: tuple[str, str | None, str], text_field: str | None,
                       start: object) -> Iterator[tuple[object, str]]:
    """Records in the dataset's order from ``start``: [record index, the streamed dataset's state before it] (its
    ``state_dict()``: shards before it are not read again), or an index alone (the records before it streamed past)."""
    name, config, split = dataset  # spec parsed (documents.parse_dataset_id)
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
