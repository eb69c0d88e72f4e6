"""The general healing texts' readers (mha2mla/io/assets.py): a character vector out of an R lazy-load database,
and a novel stored one printed line per element joined into paragraphs."""

from __future__ import annotations

import struct
import zlib

import pytest

from mha2mla import UserError
from mha2mla.io.assets import general_text_path, novel_text, r_character_vector, r_lazy_load_vectors


def _serialized(strings: list[str | None], version: int = 3, kind: int = 16) -> bytes:
    """R's XDR serialization of a character vector (NA for None), as ``saveRDS(..., compress=FALSE)`` writes it."""
    head = b"X\n" + struct.pack(">iii", version, 0x040201, 0x030500 if version == 3 else 0x020300)
    if version == 3:
        head += struct.pack(">i", 5) + b"UTF-8"
    body = struct.pack(">ii", kind, len(strings))
    for text in strings:
        data = b"" if text is None else text.encode("utf-8")
        body += struct.pack(">ii", 0x00040009, -1 if text is None else len(data)) + data
    return head + body


def _database(*objects: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(raw)) + zlib.compress(raw) for raw in objects)


@pytest.mark.parametrize("version", [2, 3])
def test_a_character_vector_is_read_back_without_its_missing_values(version):
    assert r_character_vector(_serialized(["EMMA", "", None, "Miss Woodhouse — é"], version)) == [
        "EMMA", "", "Miss Woodhouse — é"]


def test_a_database_yields_its_character_vectors_in_order_and_skips_other_objects():
    other = _serialized(["x"], kind=13)  # an integer vector: not text
    database = _database(_serialized(["a", "b"]), other, _serialized(["c"]))
    assert r_lazy_load_vectors(database) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError):
        r_character_vector(b"RDX2\n")


def test_a_novel_becomes_one_line_per_paragraph():
    lines = ["CHAPTER I", "", "", "Emma Woodhouse, handsome,", "clever, and rich.", "", "She was the youngest."]
    assert novel_text(lines) == "CHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich.\n\nShe was the youngest.\n"


def test_an_unknown_general_text_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="choose one of"):
        general_text_path("fortunes")
