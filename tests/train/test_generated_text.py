"""`mha2mla recover --teacher SOURCE` with no --data: the teacher's own text (mha2mla/train/data/generated.py), seeded,
cached chunk by chunk and reused, a run trained on it, and the one-sentence error when there is neither."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from common import build_source, run_cli

from mha2mla import UserError
from mha2mla.io.loader import load_tokenizer
from mha2mla.train import RecoverConfig, recover
from mha2mla.train.data import generated as generated_module
from mha2mla.train.data.generated import document_positions, generated_rows
from mha2mla.train.data.packing import target_mask
from mha2mla.train.model.teacher import load_teacher


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    """A tiny random Llama source with the tiny MLA model's vocabulary (384), usable as its teacher."""
    return build_source(tmp_path_factory.mktemp("teacher") / "source", vocab_size=384)


@pytest.fixture(scope="module")
def teacher(teacher_folder):
    return load_teacher(str(teacher_folder)), load_tokenizer(teacher_folder)


def _rows(teacher, cache: Path, **overrides):
    model, tokenizer = teacher
    settings = {"rows": 10, "seq_len": 24, "seed": 0, "batch_size": 4, "show_progress": False}
    return generated_rows(model, tokenizer, cache_folder=cache, **{**settings, **overrides})


def _chunks(cache: Path) -> list[Path]:
    return sorted(cache.rglob("chunk-*.safetensors"))


def test_positions_restart_after_eos_but_not_after_the_start_token():
    ids = torch.tensor([[0, 5, 6, 0, 7, 8, 0], [0, 0, 3, 4, 5, 6, 7]])  # 0 is EOS and the start token
    positions = document_positions(ids, eos_id=0)
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4]]
    assert target_mask(positions)[0].tolist() == [True, True, True, False, True, True]


def test_generation_is_deterministic_for_a_seed(teacher, tmp_path):
    first, again = _rows(teacher, tmp_path / "a"), _rows(teacher, tmp_path / "b")
    assert first.input_ids.shape == first.position_ids.shape == (10, 24)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.position_ids, again.position_ids)
    assert (first.input_ids[:, 0] == 0).all() and first.input_ids.max() < 256  # BOS, then the tokenizer's ids only
    assert not torch.equal(_rows(teacher, tmp_path / "a", seed=1).input_ids, first.input_ids)
    cooler = _rows(teacher, tmp_path / "a", temperature=0.5, top_p=0.9)
    assert not torch.equal(cooler.input_ids, first.input_ids)
    assert len(list((tmp_path / "a").iterdir())) == 3  # one cache entry per setting
    # chunk k does not depend on the chunks before it: fewer rows are the first rows of more
    assert torch.equal(_rows(teacher, tmp_path / "c", rows=3).input_ids, first.input_ids[:3])


def test_a_killed_generation_resumes_with_the_missing_chunks_only(teacher, tmp_path, monkeypatch):
    full = _rows(teacher, tmp_path)
    chunks = _chunks(tmp_path)
    assert [path.name for path in chunks] == [f"chunk-0000{k}.safetensors" for k in range(3)]
    meta = json.loads((chunks[0].parent / "meta.json").read_text())
    assert meta["seq_len"] == 24 and meta["seed"] == 0 and meta["teacher"]["files"]
    kept = chunks[0].stat().st_mtime_ns
    for path in chunks[1:]:
        path.unlink()  # killed before these were written
    sampled = []
    real = generated_module.sample_chunk
    monkeypatch.setattr(generated_module, "sample_chunk", lambda *args: sampled.append(args[4]) or real(*args))
    resumed = _rows(teacher, tmp_path)
    assert sampled == [generated_module.chunk_seed(0, 1), generated_module.chunk_seed(0, 2)]
    assert torch.equal(resumed.input_ids, full.input_ids) and torch.equal(resumed.position_ids, full.position_ids)
    assert chunks[0].stat().st_mtime_ns == kept and len(_chunks(tmp_path)) == 3
    assert not list(tmp_path.rglob(".chunk-*"))  # no temporary file left behind
    sampled.clear()
    _rows(teacher, tmp_path)
    assert sampled == []  # everything reused


def _config(model: Path, teacher: Path, out: Path, **overrides) -> RecoverConfig:
    settings = {"model": str(model), "teacher": str(teacher), "out": str(out), "seq_len": 32, "batch_size": 4,
                "max_steps": 20, "learning_rate": 1e-2, "lora": {"rank": 8}, "eval_sequences": 4, "eval_every": 0,
                "save_every": 0, "generated_temperature": 0.3,  # a peaked text: the tiny student learns it fast
                "default_data": "generated"}
    return RecoverConfig(**{**settings, **overrides})


def test_recovery_without_data_trains_on_the_teachers_text_and_reuses_it(tiny_mla, teacher_folder, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "recovered"
    report = recover(_config(tiny_mla, teacher_folder, out), show_progress=False)
    first, last = report["evaluations"][0], report["evaluations"][-1]
    assert last["perplexity"] < 0.9 * first["perplexity"]
    assert sum(report["losses"][-5:]) < sum(report["losses"][:5])
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert json.loads((out / "recovery_report.json").read_text())["settings"]["data"] is None
    chunks = _chunks(tmp_path / "cache" / "generated_text")
    assert len(chunks) == -(-(20 * 4 + 4) // generated_module.CHUNK_ROWS)  # the steps' rows and the held-out ones
    written = {path: path.stat().st_mtime_ns for path in chunks}

    again = recover(_config(tiny_mla, teacher_folder, tmp_path / "again"), show_progress=False)
    assert {path: path.stat().st_mtime_ns for path in _chunks(tmp_path / "cache" / "generated_text")} == written
    assert again["losses"] == pytest.approx(report["losses"], rel=1e-6)


def test_a_resumed_run_without_data_reads_the_same_text(tiny_mla, teacher_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    config = _config(tiny_mla, teacher_folder, out, max_steps=6, save_every=3, eval_sequences=0,
                     keep_checkpoints_after_run=True)
    report = recover(config, show_progress=False)
    for path in out.iterdir():  # leave what a run killed after its step-3 checkpoint leaves
        if path.name not in ("checkpoints", "recover_config.json", "train_log.jsonl"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    resumed = recover(config, resume="auto", show_progress=False)
    assert resumed["resumed_from"] is not None and resumed["steps"] == 6
    assert resumed["losses"] == pytest.approx(report["losses"], rel=1e-6)


def test_generated_text_without_a_teacher_is_one_sentence(tiny_mla, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["recover", tiny_mla, "--out", out, "--max-steps", "2", "--no-progress", "--default-data",
                            "generated"], capsys)
    assert code == 2
    message = err.strip().splitlines()
    assert message == ["error: give --teacher to train on the text it generates (default_data generated), or --data."], err
    assert not out.exists()
    with pytest.raises(ValueError, match="give --teacher to train on the text it generates"):
        RecoverConfig(model=str(tiny_mla), out=str(out), max_steps=2, data=[], default_data="generated")


def test_sampling_flags_reach_the_settings(tiny_mla, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["recover", tiny_mla, "--teacher", tmp_path, "--out", out, "--max-steps", "2",
                            "--generated-top-p", "1.5"], capsys)
    assert code == 2 and "--generated-top-p" in err and not out.exists()


def test_a_run_saved_before_the_sampling_settings_existed_is_refused(tiny_mla, teacher_folder, tmp_path):
    from mha2mla.train.state.resume import check_same_run

    config = _config(tiny_mla, teacher_folder, tmp_path, data=["corpus.txt"], generated_temperature=1.0)
    saved = {key: value for key, value in config.outcome_fields().items() if not key.startswith("generated_")}
    (tmp_path / "recover_config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"settings differ from the interrupted run \(generated_temperature\)"):
        check_same_run(config, tmp_path)  # another mha2mla's settings: the checkpoint format says which resumes
