"""The healing text as library code (mha2mla/io/assets.py): derived from the cached held-out texts on first use,
kept afterwards, and a missing text is one sentence saying how to fetch it, with nothing written."""

from __future__ import annotations

import json

import pytest

from mha2mla import UserError
from mha2mla.io.assets import HEALING_FILES, general_text_path, healing_documents, healing_text_path


def _write_texts(cache, lines: dict[str, int]) -> dict[str, str]:
    texts = {name: "".join(f"{name} {i:04d} " + "x" * 3990 + "\n" for i in range(count)) for name, count in lines.items()}
    (cache / "text").mkdir(parents=True)
    for name, text in texts.items():
        (cache / "text" / f"{name}.txt").write_text(text, encoding="utf-8")
    return texts


@pytest.mark.parametrize("balanced", [False, True])
def test_healing_text_is_derived_from_the_cached_texts_once(tmp_path, monkeypatch, balanced):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    texts = _write_texts(tmp_path, {"kjv": 40, "python_docs": 100})
    path = healing_text_path(balanced)
    assert path == tmp_path / "text" / HEALING_FILES[balanced]
    rows = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == healing_documents([texts["kjv"], texts["python_docs"]], balanced)
    assert len(rows) == (2 * 12 if balanced else 12 + 30)  # the first 30% of each text, one document per line
    path.write_text('{"text": "kept"}\n', encoding="utf-8")
    assert healing_text_path(balanced).read_text(encoding="utf-8") == '{"text": "kept"}\n'  # built once, then read
    assert sorted(p.name for p in (tmp_path / "text").iterdir()) == sorted(["kjv.txt", "python_docs.txt", path.name])


def test_a_missing_text_is_one_sentence_with_the_fetch_hint_and_nothing_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    _write_texts(tmp_path, {"kjv": 10})
    with pytest.raises(UserError, match=r"Python 3\.11 documentation text is not in .*make assets"):
        healing_text_path()
    assert sorted(p.name for p in (tmp_path / "text").iterdir()) == ["kjv.txt"]


def test_an_unknown_general_text_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="choose one of"):
        general_text_path("fortunes")


def test_recover_without_data_on_an_empty_cache_says_what_to_pass(tiny_mla, tmp_path, monkeypatch, capsys):
    """An installed package (no checkout, `make assets` never ran): recover's default text is missing, and the one
    sentence names --data FILE; nothing is written."""
    from common import run_cli, snapshot

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MHA2MLA_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path), snapshot(tiny_mla)
    code, _, err = run_cli(["recover", tiny_mla, "--out", tmp_path / "out", "--max-steps", "2"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--data FILE" in lines[0], err
    assert (snapshot(tmp_path), snapshot(tiny_mla)) == before
