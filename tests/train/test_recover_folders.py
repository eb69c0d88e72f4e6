"""What `mha2mla recover` leaves in OUT (docs/recover.md, "Checkpoints and resume"): the finished OUT is the model
(its resume checkpoints in OUT/checkpoints are removed once it is written, unless --keep-checkpoints-after-run);
a run folder of the earlier layout (OUT/step-N) resumes; a finished run is never resumed, a trainer state past the
run's settings is a damaged checkpoint, and Ctrl-C says which checkpoints stay. Each refusal: one sentence, exit 2,
the folder byte-identical."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
from common import SAMPLE_TEXT

from mha2mla.io.written import MANIFEST, written_names
from mha2mla.train import RecoverConfig, RunInterrupted, recover
from mha2mla.train.loop import RecoveryRun

MODEL_FILES = ("config.json", "model.safetensors", "absorbed.safetensors", "README.md", "recovery_report.json")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(SAMPLE_TEXT * 4)
    return path


def _settings(model: Path, text: Path, out: Path, **overrides) -> dict:
    return {"model": str(model), "data": [str(text)], "out": str(out), "seq_len": 32, "batch_size": 2, "max_steps": 4,
            "learning_rate": 1e-2, "lora": {"rank": 4}, "eval_sequences": 0, "save_every": 2, **overrides}


def _flags(text: Path, out: Path) -> list[str]:
    return ["--data", str(text), "--out", str(out), "--seq-len", "32", "--batch-size", "2", "--max-steps", "4",
            "--lr", "1e-2", "--lora-rank", "4", "--eval-sequences", "0", "--save-every", "2", "--no-progress"]


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    from mha2mla.cli.main import main

    monkeypatch.setattr(sys, "argv", ["mha2mla", "recover", *args])
    capsys.readouterr()  # what the set-up runs printed
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


def _one_sentence(err: str, expected: str) -> None:
    """The last line of stderr is the one error sentence (transformers' loading bars may come before it)."""
    lines = err.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], err
    assert expected in lines[-1] and "Traceback" not in err, err


def test_a_finished_out_is_the_model_and_its_reports(tiny_mla, text, tmp_path):
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recover(RecoverConfig(**_settings(tiny_mla, text, out)), show_progress=False)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]  # peft's read of the old name
    assert all((out / name).is_file() for name in MODEL_FILES)
    assert not (out / "checkpoints").exists() and not list(out.glob("step-*"))
    # OUT's list names everything in it (the run's settings and log too) and nothing removed (the checkpoints)
    assert sorted(written_names(out)) == sorted(path.name for path in out.iterdir() if path.name != MANIFEST)
    weights = sum((out / name).stat().st_size for name in ("model.safetensors", "absorbed.safetensors"))
    assert sum(path.stat().st_size for path in out.rglob("*") if path.is_file()) <= 2 * weights


def test_keep_checkpoints_after_run_leaves_them_in_their_subfolder(tiny_mla, text, tmp_path):
    out = tmp_path / "out"
    recover(RecoverConfig(**_settings(tiny_mla, text, out, keep_checkpoints_after_run=True)), show_progress=False)
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step-000002"]  # none at the last step
    assert not list(out.glob("step-*"))
    assert {"checkpoints", "recover_config.json", "train_log.jsonl"} <= written_names(out).keys()


def test_a_file_of_the_users_in_the_checkpoints_folder_stays(tiny_mla, text, tmp_path):
    """Removing the run's checkpoints removes its step folders only; what is left is off mha2mla's list."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "my_model.bin").write_text("mine\n")
    (out / "recover_config.json").write_text("{}\n")  # a run folder, so --resume auto takes it
    recover(RecoverConfig(**_settings(tiny_mla, text, out)), resume="auto", show_progress=False)
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["my_model.bin"]
    assert "checkpoints" not in written_names(out)


def test_a_checkpoint_keeps_the_rows_position_and_a_resume_gives_it_back(tiny_mla, text, tmp_path, monkeypatch):
    """The trainer state of a checkpoint holds the training rows' own ``state_dict()`` under ``data``; a resumed run
    hands it to the rows' ``load_state_dict`` before its first step."""
    out = tmp_path / "out"
    checkpoint = _unfinished_run(tiny_mla, text, out)
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["data"]
    assert isinstance(saved, dict) and saved
    import mha2mla.train.data.rows

    loaded, prepare_rows = [], mha2mla.train.data.rows.prepare_rows

    def rows_recording_loads(*args, **kwargs):
        train_rows, held_out = prepare_rows(*args, **kwargs)
        original = train_rows.load_state_dict
        train_rows.load_state_dict = lambda state: (loaded.append(state), original(state))[1]
        return train_rows, held_out

    monkeypatch.setattr("mha2mla.train.trainer.prepare_rows", rows_recording_loads)
    report = recover(RecoverConfig(**_settings(tiny_mla, text, out)), resume="auto", show_progress=False)
    assert loaded == [saved] and report["steps"] == 4


def test_resuming_a_finished_run_from_a_named_checkpoint_is_refused_before_training(tiny_mla, text, tmp_path,
                                                                                   monkeypatch, capsys):
    out = tmp_path / "out"
    recover(RecoverConfig(**_settings(tiny_mla, text, out, keep_checkpoints_after_run=True)), show_progress=False)
    before = _snapshot(out)
    monkeypatch.setattr(RecoveryRun, "train_step", lambda *_: pytest.fail("trained before refusing"))
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), *_flags(text, out), "--resume",
                                                str(out / "checkpoints" / "step-000002")])
    assert code == 2
    _one_sentence(err, f"the run in {out} has already finished; choose another --out.")
    assert _snapshot(out) == before


def _unfinished_run(model: Path, text: Path, out: Path) -> Path:
    """A run folder as a run killed after its step-2 checkpoint leaves it."""
    recover(RecoverConfig(**_settings(model, text, out, keep_checkpoints_after_run=True)), show_progress=False)
    for path in out.iterdir():
        if path.name not in ("checkpoints", "recover_config.json", "train_log.jsonl"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out / "checkpoints" / "step-000002"


@pytest.mark.parametrize("resume", ["named", "auto"])
def test_a_trainer_state_past_the_runs_last_step_is_damaged(tiny_mla, text, tmp_path, monkeypatch, capsys, resume):
    out = tmp_path / "out"
    checkpoint = _unfinished_run(tiny_mla, text, out)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "step": 999999}))
    before = _snapshot(out)
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), *_flags(text, out), "--resume",
                                                str(checkpoint) if resume == "named" else "auto"])
    assert code == 2
    expected = f"checkpoint {checkpoint} is damaged: trainer_state.json does not read back (ValueError: it claims " \
               "step 999999 of a 4-step run)"
    _one_sentence(err, expected if resume == "named" else f"every checkpoint in {out} is damaged ({expected}.)")
    assert _snapshot(out) == before


@pytest.mark.parametrize("resume", ["named", "auto"])
@pytest.mark.parametrize("version", [None, 3])
def test_a_checkpoint_of_another_format_version_is_refused_in_one_sentence(tiny_mla, text, tmp_path, monkeypatch,
                                                                         capsys, resume, version):
    """A trainer state without a format version (written before versions) or with another one is not resumed, and
    ``--resume auto`` does not pass over it to an older checkpoint."""
    from mha2mla.train.state.checkpoint import FORMAT_VERSION, VERSION_KEY

    out = tmp_path / "out"
    checkpoint = _unfinished_run(tiny_mla, text, out)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state[VERSION_KEY] == FORMAT_VERSION
    state.pop(VERSION_KEY) if version is None else state.update({VERSION_KEY: version})
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    before = _snapshot(out)
    monkeypatch.setattr(RecoveryRun, "train_step", lambda *_: pytest.fail("trained before refusing"))
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), *_flags(text, out), "--resume",
                                                str(checkpoint) if resume == "named" else "auto"])
    assert code == 2
    _one_sentence(err, f"{checkpoint} is a checkpoint of format version {version or 1}, not {FORMAT_VERSION}: finish "
                       "that run with the mha2mla version that started it, or start it again.")
    assert _snapshot(out) == before


def _interrupt_at(monkeypatch, step: int) -> None:
    """Ctrl-C as the run's ``step``-th optimizer step starts."""
    original, calls = RecoveryRun.train_step, []

    def train_step(self, batch):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(RecoveryRun, "train_step", train_step)


def test_ctrl_c_says_the_checkpoints_are_kept_and_the_run_resumes(tiny_mla, text, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _interrupt_at(monkeypatch, 4)  # after the step-2 checkpoint
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), *_flags(text, out)])
    assert code == 130
    _one_sentence(err, f"interrupted; the checkpoints in {out / 'checkpoints'} are kept: run the same command with "
                       "--resume auto to continue from the newest.")
    assert "no partial output" not in err
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step-000002"]
    monkeypatch.undo()
    report = recover(RecoverConfig(**_settings(tiny_mla, text, out)), resume="auto", show_progress=False)
    assert report["steps"] == 4 and Path(report["resumed_from"]).name == "step-000002"


def test_ctrl_c_before_the_first_checkpoint(tiny_mla, text, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupt_at(monkeypatch, 1)
    with pytest.raises(RunInterrupted, match="interrupted before the first checkpoint; .* holds only the run's "
                                             "settings and log") as raised:
        recover(RecoverConfig(**_settings(tiny_mla, text, out)), show_progress=False)
    assert isinstance(raised.value.__cause__, KeyboardInterrupt) and raised.value.exit_code == 130
    assert sorted(path.name for path in out.iterdir()) == [".mha2mla_files", "recover_config.json", "train_log.jsonl"]
