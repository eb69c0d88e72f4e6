"""How ``make assets`` cleans the texts it fetches (benchmarks/asset_texts.py, lab code outside the package): plain
text and the fortune files' entries for the unseen-domain texts; a character vector out of an R lazy-load database
and a novel stored one printed line per element joined into paragraphs for the general healing texts."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "benchmarks" / "asset_texts.py"


def _load():
    spec = importlib.util.spec_from_file_location("asset_texts", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


texts = _load()


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
    assert texts.r_character_vector(_serialized(["EMMA", "", None, "Miss Woodhouse — é"], version)) == [
        "EMMA", "", "Miss Woodhouse — é"]


def test_a_database_yields_its_character_vectors_in_order_and_skips_other_objects():
    other = _serialized(["x"], kind=13)  # an integer vector: not text
    database = _database(_serialized(["a", "b"]), other, _serialized(["c"]))
    assert texts.r_lazy_load_vectors(database) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError):
        texts.r_character_vector(b"RDX2\n")


def test_a_novel_becomes_one_line_per_paragraph():
    lines = ["CHAPTER I", "", "", "Emma Woodhouse, handsome,", "clever, and rich.", "", "She was the youngest."]
    assert texts.novel_text(lines) == "CHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich.\n\nShe was the youngest.\n"


def test_plain_text_expands_tabs_and_cuts_blank_runs():
    assert texts.plain_text("\n\nFirst\tline   \n\n\n\n\tsecond\n\n") == "First   line\n\n        second\n"


def test_fortune_entries_are_interleaved_by_position():
    short = "A1 line\n\t\t-- someone\n%\nA2\n%\n"
    long = "B1\n%\nB2 one\n\nB2 two\n%\nB3\n%\nB4\n"
    assert texts.fortune_entries(short) == ["A1 line\n                -- someone\n", "A2\n"]
    assert texts.fortune_entries(long)[1] == "B2 one\n\nB2 two\n"  # a blank line inside an entry stays
    # positions: A1 0, A2 1/2; B1 0, B2 1/4, B3 1/2, B4 3/4 -> ties go to the earlier file
    assert texts.fortunes_text([short, long]).split("\n\n") == [
        "A1 line\n                -- someone", "B1", "B2 one", "B2 two", "A2", "B3", "B4\n"]


def test_the_command_line_prints_the_cleaned_text(tmp_path):
    (tmp_path / "a").write_text("one\n%\ntwo\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(MODULE), "fortunes", str(tmp_path / "a")], capture_output=True,
                            text=True, check=True)
    assert result.stdout == "one\n\ntwo\n"


def test_the_package_no_longer_holds_the_cleaning():
    import mha2mla.io.assets as assets

    assert not [name for name in ("plain_text", "fortunes_text", "r_lazy_load_vectors", "novel_text")
                if hasattr(assets, name)]
