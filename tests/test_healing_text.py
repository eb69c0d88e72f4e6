"""The recovery training text (mha2mla/io/assets.py, docs/recover.md "Healing SmolLM2"): every document of the first 30%
of each text, never beyond it, interleaved by position in its text."""

from __future__ import annotations

import re

from mha2mla.io.assets import HEALING_FRACTION, healing_documents


def _text(tag: str, lines: int) -> str:
    """``lines`` lines of ~4000 characters, so that each is one document, tagged with its line number."""
    return "".join(f"{tag}{i:04d} " + "x" * 3994 + "\n" for i in range(lines))


def _index(document: str) -> tuple[str, int]:
    match = re.match(r"([AB])(\d{4}) ", document)
    assert match, document[:20]
    return match.group(1), int(match.group(2))


def test_healing_documents_take_every_document_of_the_first_part_only():
    documents = [_index(d) for d in healing_documents([_text("A", 100), _text("B", 310)])]
    a = [i for tag, i in documents if tag == "A"]
    b = [i for tag, i in documents if tag == "B"]
    assert a == list(range(30))  # the lines that end by 30% of the short text, whole, in order
    assert b == list(range(93))  # and of the long one: each text weighs as much as it is long
    assert max(a) < 100 * HEALING_FRACTION and max(b) < 310 * HEALING_FRACTION  # never the held-out slice a third in


def test_healing_documents_interleave_by_position_in_their_text():
    documents = [_index(d) for d in healing_documents([_text("A", 100), _text("B", 310)])]
    positions = [i / (30 if tag == "A" else 93) for tag, i in documents]
    assert positions == sorted(positions)  # a document a fifth into its text sits by the others' a fifth in
    assert documents[:2] == [("A", 0), ("B", 0)] and documents[-1] == ("B", 92)


def test_balanced_healing_documents_take_as_many_from_each_text_spread_over_its_first_part():
    documents = [_index(d) for d in healing_documents([_text("A", 100), _text("B", 310)], balanced=True)]
    assert [tag for tag, _ in documents] == ["A", "B"] * 30  # one from each text in turn: the texts weigh alike
    a = [i for tag, i in documents if tag == "A"]
    b = [i for tag, i in documents if tag == "B"]
    assert a == list(range(30))  # the short text's whole first part
    assert b == [i * 93 // 30 for i in range(30)]  # even strides through the long text's first part...
    assert b[0] == 0 and b[-1] > 0.9 * 93 and max(b) < 310 * HEALING_FRACTION  # ...spanning it, never beyond
