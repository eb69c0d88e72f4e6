"""Documents in pieces of bounded size, for streaming (mha2mla.train.data.stream): a plain text file, one document however
long, is read ``PIECE_BYTES`` at a time and cut at whitespace, so memory holds one piece, never the file; a record
of the other formats (mha2mla.io.documents) is one piece.

``iter_pieces(unit, text_field, start)`` yields ``Piece(locator, text, first, last)``: where a later call resumes at
that piece (a text file's byte offset; a record's locator, see documents.iter_located), its text, and whether it
starts and ends its document. Concatenated, the pieces of a text file are its text (a leading byte-order mark
dropped). A full window is cut before its last whitespace byte that stands between two bytes that are not
whitespace (a word or line boundary, where byte-level BPE tokenizers split the whole text as well), else after its
last whitespace byte, else before its last character: the cut depends only on the bytes from the piece's start, so
reading from any piece's locator gives the same pieces again."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from mha2mla import UserError
from mha2mla.io.documents import PLAIN_SUFFIXES, decoded, is_local, iter_located

PIECE_BYTES = 1 << 16
_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")


class Piece(NamedTuple):
    """A document or part of one (module docstring)."""

    locator: object
    text: str
    first: bool
    last: bool


def iter_pieces(unit: str, text_field: str | None = None, start: object = None) -> Iterator[Piece]:
    """The pieces of one unit (a file or dataset id of ``documents.units``) from the piece at ``start`` (a locator this
    function yielded; None: the beginning). Blank documents are skipped and a unit without text is an error, as
    documents.iter_located says; a blank piece inside a longer text is part of it and is kept."""
    if is_local(unit) and Path(unit).suffix.lower() in PLAIN_SUFFIXES:
        yield from _text_pieces(Path(unit), start)
        return
    for locator, text in iter_located(unit, text_field, start):
        yield Piece(locator, text, True, True)


def _text_pieces(path: Path, start: int | None) -> Iterator[Piece]:
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
