"""Bad input and faults, from the command line (docs/reliability.md lists every case with its outcome).

Each refused case must exit non-zero with exactly one line on stderr (``error: ...``), no traceback, and leave the
file system as it was: every file and folder under the test's folder byte-identical, with the same mode, and
nothing added (no partial output, no hidden temporary folder). Then the other half of the promise: ``--force``
replaces an earlier mha2mla output by a swap, and what a killed run left is cleaned by the next one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from common import SAMPLE_TEXT, build_source, run_cli, tiny_tokenizer
from safetensors.torch import load_file, save_file

from mha2mla import UserError
from mha2mla.io.output import staged_output, staging_path


@pytest.fixture
def stderr_logging():
    """Log records reach stderr as in the real CLI (pytest's own handlers would swallow them)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield
    root.removeHandler(handler)
    root.setLevel(level)


def snapshot(root: Path) -> dict:
    """Every entry under ``root``: kind, permission bits and content hash (or link target)."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            mode = path.lstat().st_mode & 0o7777
            if path.is_symlink():
                entries[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[str(path.relative_to(root))] = ("dir", mode)
            else:
                entries[str(path.relative_to(root))] = ("file", mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return entries


def _copy(llama_source: Path, where: Path) -> Path:
    shutil.copytree(llama_source, where)
    return where


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def _read_only_folder(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o555)
    return path


# Each case: (tmp, model) -> (arguments, folder to run in or None, words the one sentence must hold).
def out_is_the_source(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    (src / "notes.txt").write_text("my notes\n")
    return ["convert", src, src, "--force"], None, "is the source model itself"


def out_is_the_current_folder(tmp, llama_source):
    work = tmp / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work\n")
    return ["convert", llama_source, ".", "--force"], work, "current folder"


def out_is_the_empty_current_folder(tmp, llama_source):
    (tmp / "work").mkdir()
    return ["convert", llama_source, "."], tmp / "work", "current folder"


def out_is_a_parent_of_the_current_folder(tmp, llama_source):
    (tmp / "a" / "b").mkdir(parents=True)
    return ["convert", llama_source, "..", "--force"], tmp / "a" / "b", "current folder"


def out_holds_the_source(tmp, llama_source):
    src = _copy(llama_source, tmp / "models" / "llama")
    return ["convert", src, tmp / "models", "--force"], None, "holds the source model"


def force_on_a_folder_mha2mla_did_not_write(tmp, llama_source):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine\n")
    return ["convert", llama_source, tmp / "out", "--force"], None, "not written by mha2mla"


def non_empty_out_without_force(tmp, llama_source):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine\n")
    return ["convert", llama_source, tmp / "out"], None, "not written by mha2mla"


def out_is_a_file(tmp, llama_source):
    (tmp / "out").write_text("a file\n")
    return ["convert", llama_source, tmp / "out", "--force"], None, "is a file"


def out_under_a_file(tmp, llama_source):
    (tmp / "file").write_text("a file\n")
    return ["convert", llama_source, tmp / "file" / "out"], None, "is a file, so"


def out_is_a_symlink(tmp, llama_source):
    (tmp / "real").mkdir()
    (tmp / "out").symlink_to(tmp / "real")
    return ["convert", llama_source, tmp / "out", "--force"], None, "symbolic link"


def out_in_a_read_only_folder(tmp, llama_source):
    return ["convert", llama_source, _read_only_folder(tmp / "locked") / "out"], None, "cannot write into"


def out_is_an_empty_read_only_folder(tmp, llama_source):
    return ["convert", llama_source, _read_only_folder(tmp / "out")], None, "read-only"


def missing_source(tmp, llama_source):
    return ["convert", tmp / "nosuch", tmp / "out"], None, "does not exist"


def source_is_a_plain_file(tmp, llama_source):
    (tmp / "notes.txt").write_text("not a model\n")
    return ["convert", tmp / "notes.txt", tmp / "out"], None, "not a .gguf"


def config_lacks_keys(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    _edit_config(src, num_attention_heads=None)
    return ["convert", src, tmp / "out"], None, "num_attention_heads"


def inspect_config_lacks_keys(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    _edit_config(src, num_attention_heads=None)
    return ["inspect", src], None, "num_attention_heads"


def inspect_without_config(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    (src / "config.json").unlink()
    return ["inspect", src], None, "has no config.json"


def inspect_invalid_json(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    (src / "config.json").write_text('{"model_type": "llama",')
    return ["inspect", src], None, "not valid JSON"


def shard_outside_the_source(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    (tmp / "other").mkdir()
    (src / "model.safetensors").rename(tmp / "other" / "model.safetensors")
    names = load_file(str(tmp / "other" / "model.safetensors")).keys()
    index = {"metadata": {}, "weight_map": {name: "../other/model.safetensors" for name in names}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["convert", src, tmp / "out", "--calib", "none"], None, "outside"


def down_proj_of_the_wrong_shape(tmp, llama_source):
    src = _copy(llama_source, tmp / "model")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :-8].clone()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    return ["convert", src, tmp / "out", "--calib", "none", "--no-progress"], None, "down_proj"


def kv_lora_rank_above_the_source(tmp, llama_source):
    return ["convert", llama_source, tmp / "out", "--kv-lora-rank", "100000000", "--rope-dim", "8"], None, "--kv-lora-rank"


def budget_with_explicit_ranks(tmp, llama_source):
    return ["convert", llama_source, tmp / "out", "--kv-budget", "0.25", "--kv-lora-rank", "8", "--rope-dim", "8"], None, "not both"


def unknown_profile(tmp, llama_source):
    return ["convert", llama_source, tmp / "out", "--profile", "fast"], None, "profile"


def budget_not_a_number(tmp, llama_source):
    return ["convert", llama_source, tmp / "out", "--kv-budget", "abc"], None, "--kv-budget"


def calib_invalid_json(tmp, llama_source):
    (tmp / "calib.json").write_text('{"text": "unterminated')
    return ["convert", llama_source, tmp / "out", "--calib", tmp / "calib.json"], None, "not valid JSON"


def calib_json_lines_of_lists(tmp, llama_source):
    (tmp / "calib.jsonl").write_text('["a", "b"]\n["c"]\n')
    return ["convert", llama_source, tmp / "out", "--calib", tmp / "calib.jsonl"], None, "calib.jsonl:1"


def calib_random_bytes(tmp, llama_source):
    (tmp / "calib.txt").write_bytes(bytes(range(256)) * 64)
    return ["convert", llama_source, tmp / "out", "--calib", tmp / "calib.txt"], None, "not UTF-8"


def recover_out_is_the_model(tmp, mla):
    (tmp / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    return ["recover", mla, "--data", tmp / "corpus.txt", "--out", mla, "--max-steps", "1"], None, "--out"


def recover_out_is_the_current_folder(tmp, mla):
    (tmp / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    (tmp / "work").mkdir()
    return ["recover", mla, "--data", tmp / "corpus.txt", "--out", ".", "--max-steps", "1", "--eval-sequences", "0",
            "--seq-len", "32", "--no-progress"], tmp / "work", "current folder"


CASES = [
    out_is_the_source, out_is_the_current_folder, out_is_the_empty_current_folder, out_is_a_parent_of_the_current_folder,
    out_holds_the_source, force_on_a_folder_mha2mla_did_not_write, non_empty_out_without_force, out_is_a_file,
    out_under_a_file, out_is_a_symlink, out_in_a_read_only_folder, out_is_an_empty_read_only_folder, missing_source,
    source_is_a_plain_file, config_lacks_keys, inspect_config_lacks_keys, inspect_without_config, inspect_invalid_json,
    shard_outside_the_source, down_proj_of_the_wrong_shape, kv_lora_rank_above_the_source, budget_with_explicit_ranks,
    unknown_profile, budget_not_a_number, calib_invalid_json, calib_json_lines_of_lists, calib_random_bytes,
]
RECOVER_CASES = [recover_out_is_the_model, recover_out_is_the_current_folder]


# export-gguf: (tmp, converted model) -> (arguments, folder to run in or None, words the one sentence must hold).
def export_over_the_models_own_weights(tmp, converted):
    llama_source = _copy(converted, tmp / "model")
    return ["export-gguf", llama_source, llama_source / "model.safetensors", "--force"], None, "inside the model being exported"


def export_over_a_users_file(tmp, converted):
    (tmp / "thesis.txt").write_text("years of work\n")
    return ["export-gguf", converted, tmp / "thesis.txt", "--force"], None, "not a GGUF written by mha2mla"


def export_into_a_read_only_folder(tmp, converted):
    return ["export-gguf", converted, _read_only_folder(tmp / "ro") / "x.gguf"], None, "cannot write into"


def export_over_a_folder(tmp, converted):
    (tmp / "out.gguf").mkdir()
    return ["export-gguf", converted, tmp / "out.gguf", "--force"], None, "is a folder"


def export_over_a_symlink(tmp, converted):
    (tmp / "real.gguf").write_bytes(b"GGUF")
    (tmp / "out.gguf").symlink_to(tmp / "real.gguf")
    return ["export-gguf", converted, tmp / "out.gguf", "--force"], None, "symbolic link"


EXPORT_CASES = [export_over_the_models_own_weights, export_over_a_users_file, export_into_a_read_only_folder,
                export_over_a_folder, export_over_a_symlink]


def _refused(args, cwd, needle, root: Path, capsys, monkeypatch) -> None:
    if cwd is not None:
        monkeypatch.chdir(cwd)
    before = snapshot(root)
    code, _, err = run_cli(args, capsys)
    lines = err.strip().splitlines()
    assert code != 0, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert snapshot(root) == before


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_refused_with_one_sentence_and_nothing_changed(case, llama_source, tmp_path, capsys, monkeypatch, stderr_logging):
    args, cwd, needle = case(tmp_path, llama_source)
    _refused(args, cwd, needle, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("case", RECOVER_CASES, ids=lambda case: case.__name__)
def test_recover_refused_with_one_sentence(case, tiny_mla, tmp_path, capsys, monkeypatch, stderr_logging):
    args, cwd, needle = case(tmp_path, tiny_mla)
    before = snapshot(tiny_mla)
    _refused(args, cwd, needle, tmp_path, capsys, monkeypatch)
    assert snapshot(tiny_mla) == before


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A portable conversion of the tiny source, the input export-gguf accepts."""
    from mha2mla.convert.options import ConvertOptions
    from mha2mla.convert.pipeline import convert

    base = tmp_path_factory.mktemp("converted")
    source = build_source(base / "src", "llama", num_heads=4, num_kv_heads=2, with_tokenizer=False)
    tiny_tokenizer(384).save_pretrained(source)  # large enough to have BPE merges, which llama.cpp needs
    out = base / "mla"
    convert(source, out, ConvertOptions(calib="none"), progress=False)
    return out


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda case: case.__name__)
def test_export_refused_with_one_sentence(case, converted, tmp_path, capsys, monkeypatch, stderr_logging):
    args, cwd, needle = case(tmp_path, converted)
    before = snapshot(converted)
    _refused(args, cwd, needle, tmp_path, capsys, monkeypatch)
    assert snapshot(converted) == before


def test_export_force_replaces_only_its_own_gguf(converted, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    code, _, err = run_cli(["export-gguf", converted, out, "--type", "f32"], capsys)
    assert code == 0, err
    first = out.read_bytes()
    code, _, err = run_cli(["export-gguf", converted, out, "--type", "f16", "--force"], capsys)
    assert code == 0, err
    assert out.read_bytes() != first and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _convert(llama_source: Path, out: Path, capsys, *extra) -> str:
    code, _, err = run_cli(["convert", llama_source, out, "--calib", "none", "--no-progress", *extra], capsys)
    assert code == 0, err
    return err


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_force_swaps_an_earlier_output_and_leaves_nothing_behind(llama_source, tmp_path, capsys):
    out = tmp_path / "out"
    _convert(llama_source, out, capsys)
    first = (out / "conversion_report.json").read_text()
    _convert(llama_source, out, capsys, "--force", "--kv-budget", "0.5")
    assert (out / "conversion_report.json").read_text() != first
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # no staging or moved-aside folder
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # a folder as the user would make it


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_killed_runs_leftovers_are_cleaned_by_the_next_run(llama_source, tmp_path, capsys):
    out, dead = tmp_path / "out", _dead_pid()
    staged = staging_path(out).name.split(".")  # ['', 'out', 'mha2mla-tmp', PID, HOST, RANDOM]
    stale = tmp_path / ".".join([*staged[:3], str(dead), *staged[4:]])
    stale.mkdir()
    (stale / ".tensors.spool").write_bytes(b"\0" * 1024)
    moved_aside = tmp_path / ".".join(["", "earlier", "mha2mla-old", str(dead), staged[4], "0123abcd"])
    moved_aside.mkdir()
    (moved_aside / "conversion_report.json").write_text("{}\n")
    alive = tmp_path / ".".join([*staged[:3], str(os.getpid()), *staged[4:5], "feedbeef"])
    alive.mkdir()
    _convert(llama_source, out, capsys)
    assert not stale.exists()  # a dead writer's partial output: removed
    assert (tmp_path / "earlier" / "conversion_report.json").exists()  # a replacement that never came: put back
    assert alive.exists()  # a running writer's folder: untouched


def test_inspect_counts_kv_bytes_as_the_plan_does(llama_source, capsys):
    """One definition: values per token x bytes per value of the dtype a conversion writes, named with the figure."""
    code, stdout, _ = run_cli(["inspect", llama_source, "--json"], capsys)
    info = json.loads(stdout)
    code_plan, plan, _ = run_cli(["convert", llama_source, "unused", "--dry-run", "--kv-budget", "0.25"], capsys)
    assert code == code_plan == 0
    source_bytes, converted_bytes = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) B", plan.split("KV cache per token")[1])[:2])
    row = next(row for row in info["budgets"] if row["kv_budget"] == 0.25)
    assert info["kv_dtype"].startswith("float32") and "(float32, all layers)" in plan
    assert (info["kv_bytes_per_token"], row["kv_bytes_per_token"]) == (source_bytes, converted_bytes)


def _run_folder(out: Path) -> dict:
    """A recover run folder: its settings, a checkpoint and a log."""
    (out / "step-000002").mkdir(parents=True)
    (out / "step-000002" / "state.pt").write_bytes(b"optimizer state")
    (out / "recover_config.json").write_text("{}\n")
    (out / "train_log.jsonl").write_text('{"step": 2}\n')
    return snapshot(out)


def test_recover_export_carries_the_run_folder_into_the_model(tmp_path):
    out = tmp_path / "run"
    run = _run_folder(out)
    with staged_output(out, carry=True, name="--out") as staging:
        (staging / "config.json").write_text("{}\n")
        (staging / "recovery_report.json").write_text("{}\n")
    assert {key: value for key, value in snapshot(out).items() if key in run} == run  # checkpoints and logs kept
    assert (out / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_recover_export_refuses_to_overwrite_a_file_in_the_run_folder(tmp_path):
    out = tmp_path / "run"
    _run_folder(out)
    (out / "README.md").write_text("my notes\n")
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="README.md"), staged_output(out, carry=True, name="--out") as staging:
        (staging / "README.md").write_text("# model card\n")
    assert snapshot(tmp_path) == before
