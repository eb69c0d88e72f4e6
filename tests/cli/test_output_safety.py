"""Output folders and paths (docs/reliability.md, "User files, signals and damaged folders"): --force replaces only
what an output folder's own list (.mha2mla_files) names, never recover checkpoints or a file edited since mha2mla
wrote it; an OUT name of any legal length works; a quoted ``~`` means the home folder for the checks and the writes
alike; eval never writes into or below a model folder; a device file is called what it is.

Each refused case runs through the real entry point and must exit 2 with exactly one line on stderr
(``error: ...``), no traceback, and every file and folder under the test's folder byte-identical (common.snapshot).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import SAMPLE_TEXT, refused, run_cli, tiny_output

from mha2mla.io.staging import NAME_MAX, _host, remove_stale, staging_name, staging_path
from mha2mla.io.written import MANIFEST, record_written, written_names
from mha2mla.train.state import checkpoint as ckpt

LONG = "m" * 240  # a legal name; its staging name would be about 280 bytes written out in full


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """An mha2mla output folder. Shared: tests copy it before changing it."""
    return tiny_output(tmp_path_factory.mktemp("output_safety"))


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(SAMPLE_TEXT)
    return path


def _force(llama_source, out) -> list:
    return ["convert", llama_source, out, "--calib", "none", "--force", "--no-progress"]


# ---- --force replaces only what the folder's own list names ---------------------------------------------------------

def test_force_keeps_a_users_checkpoints_folder(llama_source, converted, tmp_path, capsys, stderr_logging):
    out = shutil.copytree(converted, tmp_path / "prev")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "my_model.bin").write_text("mine\n")
    line = refused(_force(llama_source, out), "did not write", tmp_path, capsys)
    assert "checkpoints/" in line


@pytest.mark.parametrize("name", ["train_log.jsonl", "recover_config.json", "step-000004"])
def test_force_keeps_a_users_entry_named_like_a_run_file(name, llama_source, converted, tmp_path, capsys,
                                                         stderr_logging):
    out = shutil.copytree(converted, tmp_path / "prev")
    (out / name).write_text("mine\n")
    assert name in refused(_force(llama_source, out), "did not write", tmp_path, capsys)


@pytest.mark.parametrize("where", ["checkpoints/step-000004"])
def test_force_refuses_a_folder_with_resumable_checkpoints(where, llama_source, converted, tmp_path, capsys,
                                                           stderr_logging):
    out = shutil.copytree(converted, tmp_path / "prev")
    (out / where).mkdir(parents=True)
    (out / where / "trainer_state.json").write_text('{"step": 4}\n')
    record_written(out, {where.split("/")[0]: None})  # mha2mla's own, as a recover run lists them
    line = refused(_force(llama_source, out), "checkpoints of a recover run", tmp_path, capsys)
    assert where in line and "--resume auto" in line


def test_force_refuses_a_hand_edited_model_card(llama_source, converted, tmp_path, capsys, stderr_logging):
    out = shutil.copytree(converted, tmp_path / "prev")
    with open(out / "README.md", "a") as card:
        card.write("\n## My results\n")
    refused(_force(llama_source, out), "model card mha2mla wrote (README.md), edited since", tmp_path, capsys)


def test_force_replaces_an_unchanged_output_and_lists_it_again(llama_source, converted, tmp_path, capsys):
    out = shutil.copytree(converted, tmp_path / "prev")
    code, _, err = run_cli(_force(llama_source, out), capsys)
    assert code == 0, err
    assert sorted(written_names(out)) == sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev"]


# ---- recover's checkpoints are on the list while they exist ---------------------------------------------------------

def _save(out: Path, step: int) -> Path:
    return ckpt.save_checkpoint(out, step, {"w": torch.zeros(2)}, {}, {}, {"step": step, "rows_consumed": 4 * step},
                                [{}])


def test_checkpoints_go_on_the_list_and_off_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _save(out, 2)
    assert "checkpoints" in written_names(out)
    (out / "checkpoints" / "notes.txt").write_text("mine\n")
    ckpt.remove_checkpoints(out)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["notes.txt"]  # the user's file stays
    assert "checkpoints" not in written_names(out)


def test_the_fallback_from_a_damaged_checkpoint_is_one_sentence(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    _save(out, 2)
    (_save(out, 4) / ckpt.OPTIMIZER_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        folder, _ = ckpt.newest_complete(out)
    assert folder.name == "step-000002"
    assert "optimizer.pt is missing; resuming from step-000002 instead." in caplog.text


# ---- a long OUT name ------------------------------------------------------------------------------------------------

def test_staging_names_fit_the_file_system_whatever_the_name(tmp_path):
    for kind in ("tmp", "old"):
        assert len(os.fsencode(staging_path(tmp_path / ("é" * 127), kind).name)) <= NAME_MAX


def test_convert_and_export_to_a_240_character_name(llama_source, converted, tmp_path, capsys):
    out = tmp_path / LONG
    for _ in range(2):  # written, then replaced with --force (moved aside under a short name)
        code, _, err = run_cli(_force(llama_source, out), capsys)
        assert code == 0, err
    gguf = tmp_path / (LONG[:-5] + ".gguf")
    for _ in range(2):
        code, _, err = run_cli(["export-gguf", converted, gguf, "--force"], capsys)
        assert code == 0, err
    assert (out / "config.json").is_file() and gguf.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LONG, gguf.name])  # no staging name left


def test_a_name_longer_than_the_file_system_allows(llama_source, converted, tmp_path, capsys, stderr_logging):
    refused(["convert", llama_source, tmp_path / ("m" * 300), "--calib", "none"], "longer than the 255 bytes",
             tmp_path, capsys)
    refused(["export-gguf", converted, tmp_path / ("m" * 300 + ".gguf")], "longer than the 255 bytes", tmp_path,
             capsys)


def test_a_killed_runs_long_named_folder_is_put_back(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()  # a PID no process has now
    holder = tmp_path / staging_name(LONG, f".mha2mla-old.{process.pid}.{_host()}.0123abcd")
    (holder / LONG).mkdir(parents=True)
    (holder / LONG / "config.json").write_text("{}\n")
    remove_stale(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [LONG] and (tmp_path / LONG / "config.json").is_file()


# ---- a quoted ~ is the home folder ----------------------------------------------------------------------------------

def test_a_quoted_tilde_is_the_home_folder(llama_source, converted, text, tmp_path, capsys, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, out, err = run_cli(["convert", llama_source, "~/x", "--calib", "none", "--no-progress"], capsys)
    assert code == 0 and out.strip().splitlines()[-1].startswith("wrote ~/x"), err
    code, out, err = run_cli(["export-gguf", converted, "~/x.gguf"], capsys)
    assert code == 0 and str(home / "x.gguf") in out, err
    code, _, err = run_cli(["eval", converted, "--text", text, "--text-tokens", "64", "--out", "~/ev"], capsys)
    assert code == 0, err
    assert (home / "x" / "config.json").is_file() and (home / "ev" / "results.json").is_file()
    assert list(work.iterdir()) == []  # nothing written to ./~


def test_recover_writes_a_quoted_tilde_out_in_the_home_folder(tiny_mla, text, tmp_path, capsys, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    args = ["recover", tiny_mla, "--data", text, "--out", "~/healed", "--seq-len", "32", "--batch-size", "2",
            "--lora-rank", "4", "--eval-sequences", "0", "--eval-every", "0", "--no-progress", "--max-steps", "1"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert (home / "healed" / "config.json").is_file() and list(work.iterdir()) == []


def test_a_quoted_tilde_is_checked_where_it_is_written(llama_source, tmp_path, capsys, monkeypatch, stderr_logging):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "x").write_text("a file\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    refused(["convert", llama_source, "~/x", "--calib", "none"], "OUT ~/x is a file", tmp_path, capsys)


# ---- eval never writes into a model folder --------------------------------------------------------------------------

def test_eval_out_below_a_model_folder(converted, text, tmp_path, capsys, stderr_logging):
    model = shutil.copytree(converted, tmp_path / "model")
    args = ["eval", converted, "--text", text, "--text-tokens", "64", "--out", model / "sub"]
    refused(args, "lies inside the model folder", tmp_path, capsys)


def test_eval_from_inside_a_model_folder_with_the_default_out(converted, text, tmp_path, capsys, monkeypatch,
                                                              stderr_logging):
    model = shutil.copytree(converted, tmp_path / "model")
    monkeypatch.chdir(model)
    line = refused(["eval", converted, "--text", text, "--text-tokens", "64"], "lies inside the model folder",
                    tmp_path, capsys)
    assert "--out ../model-eval" in line


def test_eval_keeps_a_hand_edited_report(converted, text, tmp_path, capsys, stderr_logging):
    folder = tmp_path / "reports"
    args = ["eval", converted, "--text", text, "--text-tokens", "64", "--out", folder]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    with open(folder / "results.md", "a") as table:
        table.write("\nmy notes\n")
    refused(args, "results.md, changed since mha2mla eval wrote it", tmp_path, capsys)


# ---- a device file is neither a file nor a folder ------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    lambda src, mla, text: ["convert", src, "/dev/null", "--calib", "none"],
    lambda src, mla, text: ["convert", src, "/dev/null/out", "--calib", "none"],
    lambda src, mla, text: ["export-gguf", mla, "/dev/null"],
    lambda src, mla, text: ["eval", mla, "--text", text, "--out", "/dev/null"],
    lambda src, mla, text: ["eval", mla, "--text", "/dev/zero"],
    lambda src, mla, text: ["convert", "/dev/zero", text.with_name("out"), "--calib", "none"],
    lambda src, mla, text: ["inspect", "/dev/zero"],
    lambda src, mla, text: ["eval", "/dev/zero"],
    lambda src, mla, text: ["convert", src, text.with_name("out"), "--calib", "/dev/zero"],
    lambda src, mla, text: ["recover", mla, "--data", "/dev/null", "--out", text.with_name("out"), "--max-steps", "1"],
    lambda src, mla, text: ["recover", mla, "--data", text, "--teacher", "/dev/zero", "--out", text.with_name("out"), "--max-steps", "1"],
    lambda src, mla, text: ["convert", "--recipe", "/dev/zero", text.with_name("out")],
], ids=["convert-out", "convert-under", "export-out", "eval-out", "eval-text", "convert-source", "inspect-source",
        "eval-model", "convert-calib", "recover-data", "recover-teacher", "convert-recipe"])
def test_a_device_is_called_what_it_is(command, llama_source, converted, text, tmp_path, capsys, stderr_logging):
    refused(command(llama_source, converted, text), "is not a regular", tmp_path, capsys)
    assert not text.with_name("out").exists()
