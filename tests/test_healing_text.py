"""The recovery training text (scripts/assets.py, docs/recover.md "Healing SmolLM2"): only the first 30% of each
text, the same number of documents from each, spread over the whole of that 30% for the longer text."""

from __future__ import annotations

import re

from scripts.assets import HEALING_FRACTION, healing_documents


def _text(tag: str, lines: int) -> str:
    """``lines`` lines of ~4000 characters, so that each is one document, tagged with its line number."""
    return "".join(f"{tag}{i:04d} " + "x" * 3994 + "\n" for i in range(lines))


def _index(document: str) -> tuple[str, int]:
    match = re.match(r"([AB])(\d{4}) ", document)
    assert match, document[:20]
    return match.group(1), int(match.group(2))


def test_healing_documents_interleave_equal_counts_from_the_first_part_only():
    documents = [_index(d) for d in healing_documents([_text("A", 100), _text("B", 310)])]
    a = [i for tag, i in documents if tag == "A"]
    b = [i for tag, i in documents if tag == "B"]
    assert [tag for tag, _ in documents] == ["A", "B"] * len(a)  # interleaved one to one
    assert len(a) == len(b) == 30  # the short text's lines that end by 30% of it
    assert a == list(range(30))  # the short text whole, in order
    assert max(a) < 100 * HEALING_FRACTION and max(b) < 310 * HEALING_FRACTION  # never the held-out slice a third in


def test_healing_documents_spread_over_the_longer_texts_whole_training_part():
    b = [i for tag, i in map(_index, healing_documents([_text("A", 100), _text("B", 310)])) if tag == "B"]
    assert b == sorted(set(b))  # in text order, no document twice
    assert b[0] == 0 and b[-1] == 89  # from its start to the end of its 93 training lines, not only the start
    assert {later - earlier for earlier, later in zip(b, b[1:])} == {3, 4}  # even strides (93 / 30)
