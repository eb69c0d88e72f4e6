"""recover's defaults and messages: ``activation_checkpointing: auto`` decided once by the preflight (full when every
decoder layer trains, none for LoRA with memory to spare, on where the estimate would not fit) and stated in one
line; a bad --data or --seed is the only line on stderr; --no-progress hides transformers' progress bars; the time
budget's stop sentence reads right however small the budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from common import SAMPLE_TEXT, run_cli, snapshot

from mha2mla.train import RecoverConfig
from mha2mla.train.config import MAX_SEED
from mha2mla.train.loop import stop_sentence
from mha2mla.train.memory import meta_counts, resolve_checkpointing

AMPLE = 2**50  # bytes free: everything fits


def _deep_model(tiny_mla: Path, tmp_path: Path) -> Path:
    """tiny_mla's config with eight layers (only the config: the estimate reads no weights), where checkpointing
    lowers the estimate (the layers kept outweigh the one recomputed)."""
    model = tmp_path / "deep"
    model.mkdir()
    model_config = json.loads((tiny_mla / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**model_config, "num_hidden_layers": 8}))
    return model


def _sized(model: Path, free: int | None, **settings):
    config = RecoverConfig(model=str(model), data=["corpus.txt"], out="out", max_steps=2, seq_len=64, **settings)
    return resolve_checkpointing(config, meta_counts(config), config.total_steps(), free=free)


def test_auto_is_the_default_and_full_layers_turn_full_checkpointing_on(tiny_mla, tmp_path):
    assert RecoverConfig(model="m", out="o", max_steps=1).activation_checkpointing == "auto"
    sized = _sized(_deep_model(tiny_mla, tmp_path), AMPLE, full_layers=True)
    assert sized.config.activation_checkpointing == "full"
    assert sized.checkpointing_line.startswith("activation checkpointing: full (auto: every decoder layer trains")


def test_auto_keeps_every_activation_for_lora_with_memory_to_spare(tiny_mla, tmp_path):
    model = _deep_model(tiny_mla, tmp_path)
    for free in (AMPLE, None):  # None: the free memory is unknown
        assert _sized(model, free).config.activation_checkpointing == "none"


def test_auto_checkpoints_where_the_estimate_would_not_fit(tiny_mla, tmp_path):
    model = _deep_model(tiny_mla, tmp_path)
    plain = _sized(model, AMPLE, activation_checkpointing="none").memory.total
    full = _sized(model, AMPLE, activation_checkpointing="full").memory.total
    assert full < plain
    sized = _sized(model, (plain + full) // 2)
    assert sized.config.activation_checkpointing in ("selective", "full")
    assert sized.memory.total <= (plain + full) // 2 and "would not fit" in sized.why
    # given explicitly, a mode stays, fitting or not
    assert _sized(model, full // 2, activation_checkpointing="none").config.activation_checkpointing == "none"


def test_dry_run_states_the_checkpointing_auto_chose_for_a_small_device(tiny_mla, tmp_path, monkeypatch, capsys):
    import mha2mla.train.memory

    model = _deep_model(tiny_mla, tmp_path)
    plain = _sized(model, AMPLE, activation_checkpointing="none").memory.total
    full = _sized(model, AMPLE, activation_checkpointing="full").memory.total
    monkeypatch.setattr(mha2mla.train.memory, "free_memory", lambda device: (plain + full) // 2)
    code, out, err = run_cli(["recover", model, "--data", "corpus.txt", "--out", tmp_path / "out", "--max-steps", "2",
                              "--seq-len", "64", "--dry-run"], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("activation checkpointing:")]
    assert len(lines) == 1 and "none" not in lines[0].split("(")[0] and "would not fit" in lines[0]


def _text(tmp_path: Path) -> Path:
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 4)
    return tmp_path / "text.txt"


def test_a_full_layers_run_logs_its_checkpointing_once_after_the_data_has_read(tiny_mla, tmp_path, capsys,
                                                                                stderr_logging):
    args = ["recover", tiny_mla, "--data", _text(tmp_path), "--out", tmp_path / "out", "--max-steps", "1",
            "--seq-len", "64", "--eval-sequences", "1", "--full-layers", "--no-progress"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    lines = err.splitlines()
    stated = [line for line in lines if line.startswith("activation checkpointing:")]
    assert len(stated) == 1 and stated[0].startswith("activation checkpointing: full (auto: every decoder layer")
    table = next(i for i, line in enumerate(lines) if line.startswith("memory per process"))
    assert table > next(i for i, line in enumerate(lines) if line.startswith("training data:"))
    settings = json.loads((tmp_path / "out" / "recovery_report.json").read_text())["settings"]
    assert settings["activation_checkpointing"] == "full"  # what the run trained with, decided once


def _refused(args: list, tmp_path: Path, capsys, words: str) -> None:
    before = snapshot(tmp_path)
    code, _, err = run_cli(args, capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert words in lines[0] and "Traceback" not in err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case", ["missing file", "too short for one row"])
def test_a_data_error_is_the_only_line(tiny_mla, tmp_path, capsys, stderr_logging, case):
    if case == "missing file":
        data, words = tmp_path / "nosuch.txt", "does not exist"
    else:
        data, words = tmp_path / "short.txt", "fewer than one packed sequence"
        data.write_text("hi")
    _refused(["recover", tiny_mla, "--data", data, "--out", tmp_path / "out", "--max-steps", "2", "--no-progress"],
             tmp_path, capsys, words)


@pytest.mark.parametrize("seed", ["-1", str(MAX_SEED + 1)])
def test_a_seed_out_of_range_is_one_line_naming_it(tiny_mla, tmp_path, capsys, stderr_logging, seed):
    _refused(["recover", tiny_mla, "--data", _text(tmp_path), "--out", tmp_path / "out", "--max-steps", "2",
              "--seed", seed], tmp_path, capsys, "--seed")


def test_the_largest_seed_is_accepted():
    assert RecoverConfig(model="m", out="o", max_steps=1, seed=MAX_SEED).seed == MAX_SEED


@pytest.mark.parametrize("no_progress", [False, True])
def test_no_progress_hides_transformers_bars(tiny_mla, tmp_path, capsys, monkeypatch, stderr_logging, no_progress):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # as at a terminal: the bars show unless turned off
    args = ["recover", tiny_mla, "--data", _text(tmp_path), "--out", tmp_path / "out", "--max-steps", "1",
            "--seq-len", "64", "--eval-sequences", "0", *(["--no-progress"] if no_progress else [])]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert ("Loading weights" in err) is not no_progress and ("recover:" in err) is not no_progress


def test_the_time_budget_sentence_reads_right_for_a_tiny_budget():
    over = stop_sentence(0, 1.2, 0.004, 0.3)
    assert over == "--max-time: stopping before the first step: 1.2 s spent, past the 0.004 s budget; writing the model"
    under = stop_sentence(7, 3500.4, 3600, 120.2)
    assert "after step 7: 3500 s of the 3600 s budget spent, and one more step (about 120 s)" in under


def test_a_zero_time_budget_is_refused_in_one_line(tiny_mla, tmp_path, capsys):
    _refused(["recover", tiny_mla, "--data", _text(tmp_path), "--out", tmp_path / "out", "--max-steps", "2",
              "--max-time", "0"], tmp_path, capsys, "--max-time")
