"""``--max-time``: the training loop stops before a step that would end past the budget, and the run ends as any run
does (final evaluation, the model written, checkpoints removed); the budget counts the time of earlier attempts of
a resumed run, and a resumed run may be given more. A duration that does not parse is one sentence."""

from __future__ import annotations

import json
import shutil
import sys
from itertools import count
from pathlib import Path

import pytest
from common import SAMPLE_TEXT

import mha2mla.train.loop
from mha2mla.train import RecoverConfig, recover


@pytest.fixture
def text(tmp_path) -> Path:
    """Two documents: the held-out rows are the first one's (whole documents are held out), the training the other's."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(SAMPLE_TEXT * 4)
    return folder


def _config(model: Path, text: Path, out: Path, **overrides) -> RecoverConfig:
    settings = {"model": str(model), "data": [str(text)], "out": str(out), "seq_len": 32, "batch_size": 2,
                "max_steps": 6, "lora": {"rank": 4}, "eval_sequences": 2, "eval_every": 0, "save_every": 2}
    return RecoverConfig(**{**settings, **overrides})


def _clock(monkeypatch, seconds_per_reading: float = 10.0) -> None:
    """The budget's clock moves ``seconds_per_reading`` each time it is read (once per step, twice at the start)."""
    ticks = count(1)
    monkeypatch.setattr(mha2mla.train.loop, "monotonic", lambda: next(ticks) * seconds_per_reading)


def test_the_budget_stops_before_the_step_that_would_end_past_it(tiny_mla, text, tmp_path, monkeypatch):
    _clock(monkeypatch)
    out = tmp_path / "out"
    report = recover(_config(tiny_mla, text, out, max_time="45s"), show_progress=False)
    # readings 30, 40, 50 after the start: 10 s per step, the third would end at 50 s > 45 s
    assert report["steps"] == 2 and report["stopped_by_max_time"]
    assert report["evaluations"][-1]["step"] == 2  # evaluated at the step it stopped
    written = json.loads((out / "recovery_report.json").read_text())
    assert written["steps"] == 2 and (out / "model.safetensors").is_file() and not (out / "checkpoints").exists()


def test_without_a_budget_nothing_stops_early(tiny_mla, text, tmp_path, monkeypatch):
    _clock(monkeypatch, 1e6)
    report = recover(_config(tiny_mla, text, tmp_path / "out"), show_progress=False)
    assert report["steps"] == 6 and not report["stopped_by_max_time"]


def test_the_budget_counts_earlier_attempts_and_a_resume_may_extend_it(tiny_mla, text, tmp_path, monkeypatch):
    first = tmp_path / "first"
    recover(_config(tiny_mla, text, first, keep_checkpoints_after_run=True), show_progress=False)
    for path in first.iterdir():  # what a run killed after its step-4 checkpoint leaves
        if path.name not in ("checkpoints", "recover_config.json", "train_log.jsonl"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    state_file = first / "checkpoints" / "step-000004" / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "wall_seconds": 1000.0}))
    again = tmp_path / "again"
    shutil.copytree(first, again)

    _clock(monkeypatch)
    stopped = recover(_config(tiny_mla, text, first, max_time="1000s"), resume="auto", show_progress=False)
    assert stopped["steps"] == 4 and stopped["stopped_by_max_time"]  # the budget was spent before the kill
    extended = recover(_config(tiny_mla, text, again, max_time="2h"), resume="auto", show_progress=False)
    assert extended["steps"] == 6 and not extended["stopped_by_max_time"]


@pytest.mark.parametrize("given", ["5x", "-3m", "0", "m"])
def test_a_duration_that_does_not_parse_is_one_sentence(tiny_mla, text, tmp_path, monkeypatch, capsys, given):
    from mha2mla.cli.main import main

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["mha2mla", "recover", str(tiny_mla), "--data", str(text), "--out", str(out),
                                      "--max-steps", "2", f"--max-time={given}"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "is not a duration" in err[0], err
    assert not out.exists()
