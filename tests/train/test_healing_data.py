"""The default healing text (mha2mla/train/data/healing.py): the same documents for the same seed, every domain
alike in a run's first rows, built once from the cached general texts, and a missing text is one sentence; and the
benchmark's mix of generated and real text (benchmarks/heal.py, run as the benchmark runs: a script)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from mha2mla import UserError
from mha2mla.io.assets import GENERAL_TEXTS, general_text_path, split_documents
from mha2mla.train.data.healing import default_data, general_data_path, general_documents, take_turns


def _texts(counts: dict[str, int]) -> dict[str, str]:
    return {name: "".join(f"{name} {i:04d} " + "x" * 4000 + "\n" for i in range(count)) for name, count in counts.items()}


def test_the_mix_is_the_same_for_a_seed_and_another_for_another_seed():
    texts = _texts({"a": 30, "b": 12, "c": 20})
    first, again, other = (general_documents(texts, seed) for seed in (0, 0, 1))
    assert first == again
    assert first != other and Counter(first) == Counter(other)  # the same documents in another order
    assert Counter(first) == Counter(doc.strip("\n") for text in texts.values() for doc in split_documents(text))


def test_every_domain_takes_its_turn_until_it_runs_out():
    documents = general_documents(_texts({"a": 30, "b": 12, "c": 20}), seed=3)
    domains = [doc.split(" ")[0] for doc in documents]
    assert domains[:36] == ["a", "b", "c"] * 12  # every text alike while the shortest lasts
    assert domains[36:] == ["a", "c"] * 8 + ["a"] * 10
    assert take_turns([[1, 2, 3], [], [4]]) == [1, 4, 2, 3]
    assert take_turns([["g1", "g2"], ["r1", "r2", "r3"]]) == ["g1", "r1", "g2", "r2", "r3"]


def _write_general(cache) -> dict[str, str]:
    texts = _texts({name: 10 + 5 * i for i, name in enumerate(GENERAL_TEXTS)})
    for name, text in texts.items():
        general_text_path(name).parent.mkdir(parents=True, exist_ok=True)
        general_text_path(name).write_text(text, encoding="utf-8")
    return texts


def test_the_default_data_is_built_once_per_seed_from_the_cached_texts(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    texts = _write_general(tmp_path)
    path = general_data_path(seed=5)
    rows = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == general_documents(texts, 5) and len(rows) == sum(10 + 5 * i for i in range(len(GENERAL_TEXTS)))
    stamp = path.stat().st_mtime_ns
    assert general_data_path(seed=5) == path and path.stat().st_mtime_ns == stamp  # kept, not rebuilt

    class Config:
        seed = 7

    assert default_data(Config()) == [str(path.with_name("healing_general-seed7.jsonl"))]
    assert not list(path.parent.glob(".*part*"))  # nothing half-written left behind


def test_a_missing_general_text_is_one_sentence_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    _write_general(tmp_path)
    missing = next(iter(GENERAL_TEXTS))
    general_text_path(missing).unlink()
    with pytest.raises(UserError, match="make assets"):
        general_data_path(seed=0)
    assert not list(general_text_path(missing).parent.glob("*.jsonl"))


GENERATED_DOCUMENTS = """
import sys, torch
sys.path.insert(0, "benchmarks")
from heal import generated_documents

class Tokenizer:
    eos_token_id = 0

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

ids = torch.tensor([[1, 5, 6, 0, 7, 0], [1, 0, 0, 8, 9, 9]])  # the start token, then sampled tokens
print(generated_documents(ids, Tokenizer()))
"""


def test_generated_rows_become_documents_cut_at_every_eos():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", GENERATED_DOCUMENTS], cwd=root, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['w5 w6', 'w7', 'w8 w9 w9']"


def test_a_run_given_no_data_trains_on_the_general_text(tmp_path, monkeypatch):
    from common import tiny_tokenizer

    from mha2mla.train.config import RecoverConfig
    from mha2mla.train.data.rows import prepare_rows
    from mha2mla.train.data.stream import prepare_stream

    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path))
    _write_general(tmp_path)
    tokenizer = tiny_tokenizer()
    config = RecoverConfig(model="m", out=str(tmp_path / "out"), max_tokens=4096, seq_len=64, seed=3)
    rows, held_out = prepare_rows(config, tokenizer, 16)
    explicit = config.model_copy(update={"data": [str(general_data_path(3))]})
    same_rows, same_held_out = prepare_stream(explicit, tokenizer, 16)
    assert torch.equal(held_out.input_ids, same_held_out.input_ids)
    assert torch.equal(rows.rows_at([0], 16)["input_ids"], same_rows.rows_at([0], 16)["input_ids"])
