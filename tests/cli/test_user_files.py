"""A user's files under --force and eval --out, SIGTERM, damaged model folders and the words of the CLI
(docs/reliability.md, "User files, signals and damaged folders").

Each refused case runs through the real entry point and must exit non-zero with exactly one line on stderr
(``error: ...``), no traceback, and every file and folder under the test's folder byte-identical (common.snapshot).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from common import SAMPLE_TEXT, refused, run_cli, snapshot, tiny_output

from mha2mla.io.written import MANIFEST, written_names


def _last_line(err: str, needle: str) -> None:
    """A command that got going (progress, log lines) ends with one sentence about the interruption."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last and "error:" not in err.strip()[: -len(last)], err


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """An mha2mla output folder. Shared: tests copy it before changing it."""
    return tiny_output(tmp_path_factory.mktemp("user_files"))


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(SAMPLE_TEXT)
    return path


# ---- --force replaces only what mha2mla wrote -----------------------------------------------------------------------

def test_every_output_lists_what_mha2mla_wrote(converted):
    listed = written_names(converted)
    assert sorted(listed) == sorted(p.name for p in converted.iterdir() if p.name != MANIFEST)
    assert {"config.json", "conversion_report.json", "model.safetensors"} <= set(listed)
    assert listed["README.md"] and listed["config.json"]  # small files with the hash they were written with


def test_force_refuses_an_output_holding_the_users_files(llama_source, converted, tmp_path, capsys, stderr_logging):
    out = shutil.copytree(converted, tmp_path / "out")
    (out / "my_notes.txt").write_text("what I found\n")
    (out / "results").mkdir()
    (out / "results" / "table.csv").write_text("a,b\n")
    line = refused(["convert", llama_source, out, "--calib", "none", "--force"], "did not write", tmp_path, capsys)
    assert "my_notes.txt" in line and "results/" in line


def test_force_refuses_an_output_written_before_manifests(llama_source, converted, tmp_path, capsys, stderr_logging):
    out = shutil.copytree(converted, tmp_path / "out")
    (out / MANIFEST).unlink()  # an output of an mha2mla without the list: no name is taken as its own by its shape
    (out / "my_notes.txt").write_text("what I found\n")
    line = refused(["convert", llama_source, out, "--calib", "none", "--force"], "delete it by hand", tmp_path, capsys)
    assert MANIFEST in line


def test_force_still_replaces_an_output_of_only_its_own_files(llama_source, converted, tmp_path, capsys):
    out = shutil.copytree(converted, tmp_path / "out")
    code, _, err = run_cli(["convert", llama_source, out, "--calib", "none", "--force", "--no-progress"], capsys)
    assert code == 0, err
    assert (out / MANIFEST).is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- eval --out never overwrites a file it did not write ------------------------------------------------------------

def test_eval_out_keeps_a_users_results_md(converted, text, tmp_path, capsys, stderr_logging):
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "results.md").write_text("# my own results\n")
    refused(["eval", converted, "--text", text, "--text-tokens", "64", "--out", folder], "results.md", tmp_path, capsys)


def test_eval_out_refuses_a_model_folder(converted, text, tmp_path, capsys, stderr_logging):
    model = shutil.copytree(converted, tmp_path / "model")
    refused(["eval", converted, "--text", text, "--text-tokens", "64", "--out", model], "is a model folder", tmp_path,
             capsys)


def test_eval_out_replaces_its_own_report_and_keeps_the_users_files(converted, text, tmp_path, capsys):
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    args = ["eval", converted, "--text", text, "--text-tokens", "64", "--out", folder]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    first = json.loads((folder / "results.json").read_text())
    assert first["written_by"] == "mha2mla eval" and "results.md" in first["files"]
    code, _, err = run_cli(args, capsys)  # a second run replaces what the first wrote
    assert code == 0, err
    assert (folder / "notes.txt").read_text() == "mine\n"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no staging folder left


# ---- SIGTERM is handled like Ctrl-C ------------------------------------------------------------------------------

def _sigterm_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not interrupt")  # never reached: the handler raises


def test_sigterm_mid_convert_removes_the_staging_folder(llama_source, tmp_path, capsys, monkeypatch, stderr_logging):
    import mha2mla.convert.pipeline

    monkeypatch.setattr(mha2mla.convert.pipeline, "write_model_card", _sigterm_self)  # inside the staged output
    before = snapshot(tmp_path)
    code, _, err = run_cli(["convert", llama_source, tmp_path / "out", "--calib", "none", "--no-progress"], capsys)
    assert code == 143
    _last_line(err, "terminated (SIGTERM); nothing partial was kept")
    assert snapshot(tmp_path) == before  # no OUT, no .out.mha2mla-tmp.* folder
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back after main()


def test_sigterm_mid_eval_writes_nothing(converted, text, tmp_path, capsys, monkeypatch, stderr_logging):
    import mha2mla.evaluation.report

    monkeypatch.setattr(mha2mla.evaluation.report, "plot_tasks", _sigterm_self)
    before = snapshot(tmp_path)
    code, _, err = run_cli(["eval", converted, "--text", text, "--text-tokens", "64", "--out", tmp_path / "r"], capsys)
    assert code == 143
    _last_line(err, "terminated (SIGTERM)")
    assert snapshot(tmp_path) == before


def test_sigterm_mid_export_gguf_leaves_no_staging_file(converted, tmp_path, capsys, monkeypatch, stderr_logging):
    pytest.importorskip("gguf")
    import mha2mla.export.gguf

    monkeypatch.setattr(mha2mla.export.gguf.gguf.GGUFWriter, "write_header_to_file", _sigterm_self)
    before = snapshot(tmp_path)
    code, _, err = run_cli(["export-gguf", converted, tmp_path / "m.gguf", "--type", "f32"], capsys)
    assert code == 143
    _last_line(err, "terminated (SIGTERM)")
    assert snapshot(tmp_path) == before


def test_sigterm_to_a_real_convert_process(llama_source, tmp_path):
    """The signal from outside, as `timeout` sends it: the process is held inside its staged output by a
    sitecustomize that waits on a file, then signalled."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\nimport mha2mla.convert.pipeline as p\n"
        "def held(*a, **k):\n    open(os.environ['READY'], 'w').close()\n    time.sleep(60)\n"
        "p.write_model_card = held\n")
    ready, work = tmp_path / "ready", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "READY": str(ready)}
    process = subprocess.Popen([sys.executable, "-m", "mha2mla.cli.main", "convert", str(llama_source), str(work / "out"),
                                "--calib", "none", "--no-progress"], env=env, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):
        if ready.exists() or process.poll() is not None:
            break
        subprocess.run(["sleep", "0.1"])
    assert ready.exists(), process.communicate()[1]
    assert any(p.name.startswith(".out.mha2mla-tmp.") for p in work.iterdir())  # held inside the staging folder
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)"), err
    assert list(work.iterdir()) == []


# ---- damaged model folders: one sentence from every command ---------------------------------------------------------

def _truncated(converted: Path, where: Path, name: str = "model.safetensors") -> Path:
    model = shutil.copytree(converted, where)
    data = (model / name).read_bytes()
    (model / name).write_bytes(data[: len(data) // 2])
    return model


def test_eval_on_a_truncated_model(converted, text, tmp_path, capsys, stderr_logging):
    model = _truncated(converted, tmp_path / "model")
    refused(["eval", model, "--text", text, "--text-tokens", "64", "--out", tmp_path / "r"], "is damaged", tmp_path,
             capsys)


def test_recover_on_a_truncated_model(converted, text, tmp_path, capsys, stderr_logging):
    model = _truncated(converted, tmp_path / "model")
    refused(["recover", model, "--data", text, "--out", tmp_path / "run", "--max-steps", "1"], "is damaged",
             tmp_path, capsys)


def test_generate_on_garbage_absorbed_weights(converted, tmp_path, capsys, stderr_logging):
    model = shutil.copytree(converted, tmp_path / "model")
    (model / "absorbed.safetensors").write_bytes(os.urandom(4096))
    refused(["generate", model, "-p", "the"], "absorbed.safetensors is damaged", tmp_path, capsys)


def test_every_command_names_the_same_damage(converted, text, tmp_path, capsys, stderr_logging):
    model = _truncated(converted, tmp_path / "model")
    lines = {command: refused(args, "is damaged", tmp_path, capsys) for command, args in {
        "convert": ["convert", model, tmp_path / "out", "--calib", "none"],
        "generate": ["generate", model, "-p", "the"],
        "eval": ["eval", model, "--text", text, "--out", tmp_path / "r"],
    }.items()}
    assert len(set(lines.values())) == 1, lines


# ---- recipes and checks before any model loads ----------------------------------------------------------------------

def test_recipe_of_non_utf8_bytes(llama_source, tmp_path, capsys, stderr_logging):
    (tmp_path / "recipe.yaml").write_bytes(b"convert:\n  kv_budget: 0.25\n\xff\xfe\x00garbage\n")
    refused(["convert", llama_source, tmp_path / "out", "--recipe", tmp_path / "recipe.yaml"], "is not UTF-8",
             tmp_path, capsys)


def test_recipe_that_is_a_folder(llama_source, tmp_path, capsys, stderr_logging):
    (tmp_path / "recipes").mkdir()
    refused(["convert", llama_source, tmp_path / "out", "--recipe", tmp_path / "recipes"], "is a folder", tmp_path,
             capsys)


def test_generate_refuses_a_device_before_reading_the_model(tmp_path, capsys, stderr_logging):
    model = tmp_path / "model"
    model.mkdir()  # nothing to load: the device is refused first
    refused(["generate", model, "-p", "the", "--device", "toaster"], "'toaster' is not a device", tmp_path, capsys)


@pytest.mark.parametrize("command", ["convert", "inspect", "eval", "recover", "generate", "export-gguf"])
def test_help_names_values_without_python_types(command, capsys):
    code, out, _ = run_cli([command, "--help"], capsys)
    assert code == 0
    for placeholder in ("<str>", "<path>", "<list[", "<int>", "<float>", "<bool>"):
        assert placeholder not in out, (placeholder, out)


def test_sigterm_mid_recover_keeps_the_checkpoints(tiny_mla, text, tmp_path, capsys, monkeypatch, stderr_logging):
    """recover's own interruption sentence, as SIGTERM: the saved checkpoints stay for --resume auto, exit 143."""
    from mha2mla.train.loop import RecoveryRun

    original, calls = RecoveryRun.train_step, []

    def train_step(self, batch):
        calls.append(1)
        if len(calls) == 4:  # after the step-2 checkpoint
            _sigterm_self()
        return original(self, batch)

    monkeypatch.setattr(RecoveryRun, "train_step", train_step)
    (tmp_path / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    out = tmp_path / "out"
    code, _, err = run_cli(["recover", tiny_mla, "--data", tmp_path / "corpus.txt", "--out", out, "--seq-len", "32",
                            "--batch-size", "2", "--max-steps", "4", "--lora-rank", "4", "--eval-sequences", "0",
                            "--save-every", "2", "--no-progress"], capsys)
    assert code == 143
    _last_line(err, "terminated (SIGTERM); the checkpoints in")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    assert not [p.name for p in tmp_path.iterdir() if ".mha2mla-" in p.name]
