"""Bad input and faults, from the command line (docs/reliability.md lists every case with its outcome).

Each refused case must exit non-zero with exactly one line on stderr (``error: ...``), no traceback, and leave the
file system as it was: every file and folder under the test's folder byte-identical, with the same mode, and
nothing added (no partial output, no hidden temporary folder). Then the other half of the promise: ``--force``
replaces an earlier mha2mla output by a swap, and what a killed run left is cleaned by the next one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common import SAMPLE_TEXT, build_source, run_cli, snapshot, tiny_deepseek_config, tiny_tokenizer
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mha2mla import UserError
from mha2mla.io.output import staged_output, staging_path


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
    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    base = tmp_path_factory.mktemp("converted")
    source = build_source(base / "src", "llama", num_heads=4, num_kv_heads=2, with_tokenizer=False)
    tiny_tokenizer(384).save_pretrained(source)  # large enough to have BPE merges, which llama.cpp needs
    out = base / "mla"
    convert(source, out, ConvertConfig(calib="none"), progress=False)
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


# ---- issue #29: every other command keeps convert's promises ------------------------------------------------------
# Each case: (tmp, source model, converted MLA model) -> (arguments, folder to run in or None, words of the sentence).

def calib_device_unknown(tmp, llama_source, converted):
    return ["convert", llama_source, tmp / "out", "--calib-device", "toaster"], None, "'toaster' is not a device"


def generate_device_unknown(tmp, llama_source, converted):
    return ["generate", converted, "-p", "the", "--device", "toaster"], None, "'toaster' is not a device"


def eval_device_unknown(tmp, llama_source, converted):
    return ["eval", converted, "--device", "toaster", "--out", tmp / "eval"], None, "'toaster' is not a device"


def eval_out_is_a_file(tmp, llama_source, converted):
    (tmp / "results").write_text("my results\n")
    (tmp / "text.txt").write_text(SAMPLE_TEXT)
    return ["eval", converted, "--out", tmp / "results", "--text", tmp / "text.txt"], None, "is a file"


def generate_temperature_nan(tmp, llama_source, converted):
    return ["generate", converted, "-p", "the", "--temperature", "nan"], None, "invalid --temperature: input should be a finite number"


def generate_temperature_negative(tmp, llama_source, converted):
    return ["generate", converted, "-p", "the", "--temperature", "-1"], None, "invalid --temperature: input should be greater than or equal to 0"


def generate_top_p_nan(tmp, llama_source, converted):
    return ["generate", converted, "-p", "the", "--temperature", "1", "--top-p", "nan"], None, "invalid --top-p: input should be a finite number"


def generate_prompt_longer_than_the_context(tmp, llama_source, converted):
    return ["generate", converted, "-p", "the keys " * 400], None, "context holds 512"


def export_unknown_pre_tokenizer(tmp, llama_source, converted):
    return ["export-gguf", converted, tmp / "x.gguf", "--pre", "nosuchpre"], None, "not a pre-tokenizer llama.cpp knows"


def inspect_a_gguf_of_random_bytes(tmp, llama_source, converted):
    (tmp / "random.gguf").write_bytes(bytes(range(256)) * 16)
    return ["inspect", tmp / "random.gguf"], None, "could not read"


def inspect_an_empty_gguf(tmp, llama_source, converted):
    (tmp / "empty.gguf").write_bytes(b"")
    return ["inspect", tmp / "empty.gguf"], None, "could not read"


def recover_out_is_a_plain_source_folder(tmp, llama_source, converted):
    (tmp / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    return ["recover", converted, "--data", tmp / "corpus.txt", "--out", _copy(llama_source, tmp / "llama"), "--max-steps", "1"], \
        None, "was not written by mha2mla recover"


ISSUE_29_CASES = [
    calib_device_unknown, generate_device_unknown, eval_device_unknown, eval_out_is_a_file, generate_temperature_nan,
    generate_temperature_negative, generate_top_p_nan, generate_prompt_longer_than_the_context,
    export_unknown_pre_tokenizer, inspect_a_gguf_of_random_bytes, inspect_an_empty_gguf,
    recover_out_is_a_plain_source_folder,
]


@pytest.mark.parametrize("case", ISSUE_29_CASES, ids=lambda case: case.__name__)
def test_other_commands_refuse_with_one_sentence(case, llama_source, converted, tmp_path, private_cache, capsys, monkeypatch,
                                                 stderr_logging):
    args, cwd, needle = case(tmp_path, llama_source, converted)
    before = snapshot(converted)
    _refused(args, cwd, needle, tmp_path, capsys, monkeypatch)
    assert snapshot(converted) == before


@pytest.mark.parametrize("command", ["convert", "generate", "eval"])
def test_cuda_asked_for_on_a_machine_without_it(command, llama_source, converted, tmp_path, capsys, monkeypatch,
                                                stderr_logging):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = {"convert": ["convert", llama_source, tmp_path / "out", "--calib-device", "cuda"],
            "generate": ["generate", converted, "-p", "the", "--device", "cuda:1"],
            "eval": ["eval", converted, "--device", "cuda", "--out", tmp_path / "eval"]}[command]
    _refused(args, None, "no CUDA GPU is visible", tmp_path, capsys, monkeypatch)


def test_generate_caps_new_tokens_at_the_context(converted, capsys, stderr_logging):
    code, _, err = run_cli(["generate", converted, "-p", "the latent", "-n", "100000000", "--ignore-eos"], capsys)
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 1, err
    capped = re.fullmatch(r"--max-new-tokens 100000000 capped at (\d+): the context holds (\d+) tokens and the "
                          r"longest prompt has (\d+)\.", lines[0])
    assert capped and int(capped[1]) + int(capped[3]) == int(capped[2]) == 512, lines[0]


def test_generate_with_a_temperature_that_overflows_is_greedy(converted, capsys):
    greedy = run_cli(["generate", converted, "-p", "the latent", "-n", "8", "--ignore-eos"], capsys)
    tiny = run_cli(["generate", converted, "-p", "the latent", "-n", "8", "--ignore-eos", "--temperature", "1e-45"], capsys)
    assert tiny[0] == 0 and tiny == greedy, tiny


def test_ctrl_c_prints_its_one_line(llama_source, tmp_path, capsys, monkeypatch, stderr_logging):
    import mha2mla.convert.pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mha2mla.convert.pipeline, "convert", interrupted)
    before = snapshot(tmp_path)
    code, _, err = run_cli(["convert", llama_source, tmp_path / "out", "--calib", "none"], capsys)
    assert code == 130 and err.strip().splitlines() == [
        "error: interrupted; nothing partial was kept; run the command again to finish."], err
    assert snapshot(tmp_path) == before


def test_inspect_rope_line_is_text_and_names_llama3_scaling_only_for_llama3(llama_source, tmp_path, capsys):
    code, plain, _ = run_cli(["inspect", llama_source], capsys)
    assert code == 0 and "rope: default, theta 10000\n" in plain and "llama3" not in plain, plain
    scaled = _copy(llama_source, tmp_path / "llama3")
    _edit_config(scaled, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 128})
    code, text, _ = run_cli(["inspect", scaled], capsys)
    assert code == 0 and "rope: llama3, theta 500000, factor 8, low_freq_factor 1" in text, text
    assert "approximated: llama3 rope scaling" in text


class _FullDiskModel:
    """What load_gguf_model returns, whose save writes part of a file and then finds the disk full (``error``)."""

    def __init__(self, error: Exception):
        self.error = error

    def save_pretrained(self, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 64)
        raise self.error


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")],
                         ids=["oserror", "safetensors"])
def test_gguf_cache_on_a_full_disk(error, tmp_path, private_cache, capsys, monkeypatch, stderr_logging):
    import mha2mla.io.source

    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(mha2mla.io.source, "load_gguf_model", lambda path, dtype=None: (_FullDiskModel(error), None))
    source_log = logging.getLogger("mha2mla.io.source")
    source_log.setLevel(logging.WARNING)  # the "dequantising X" progress line precedes the sentence
    try:
        _refused(["convert", tmp_path / "model.gguf", tmp_path / "out", "--calib", "none"], None, "No space left on device",
                 tmp_path, capsys, monkeypatch)
    finally:
        source_log.setLevel(logging.NOTSET)


def test_gguf_cache_lock_removed_when_a_gguf_does_not_load(tmp_path, private_cache, capsys, monkeypatch, stderr_logging):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)  # the magic bytes, then garbage
    before = snapshot(tmp_path)
    code, _, err = run_cli(["inspect", tmp_path / "broken.gguf"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("error: could not read"), err
    assert all(line.startswith("dequantising broken.gguf") for line in lines[:-1]), err
    assert snapshot(tmp_path) == before  # no lock, no staging folder, no cache folder


def test_export_gguf_on_a_full_disk(converted, tmp_path, capsys, monkeypatch, stderr_logging):
    import gguf

    write = gguf.GGUFWriter.write_tensor_data
    calls = []

    def full_after_one_tensor(self, *args, **kwargs):  # numpy's tofile under gguf loses the errno
        calls.append(1)
        if len(calls) > 1:
            raise OSError("4096 requested and 0 written")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_after_one_tensor)
    _refused(["export-gguf", converted, tmp_path / "model.gguf"], None, "No space left on device", tmp_path, capsys,
             monkeypatch)
    assert len(calls) == 2  # the disk filled up part-way through the file


def test_eval_kv_bytes_row_compares_in_one_dtype(llama_source, tmp_path, capsys):
    """A float32 source against a bfloat16 MLA model keeping 31.25% of its KV values: the row says bfloat16 and the
    ratio is the ratio of the cached values, not of float32 bytes to bfloat16 bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    mla = tmp_path / "mla"
    config = tiny_deepseek_config(kv_lora_rank=12, qk_rope_head_dim=8)  # 20 values per layer, the source caches 64
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(mla)
    tiny_tokenizer().save_pretrained(mla)
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    code, stdout, err = run_cli(["eval", mla, "--baseline", llama_source, "--text", tmp_path / "text.txt", "--text-tokens", "64",
                                 "--device", "cpu", "--out", tmp_path / "eval"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    source, converted = (next(r for r in report["models"] if r["role"] == role) for role in ("source", "model"))
    values = converted["measurements"]["kv_cache_values_per_token"] / source["measurements"]["kv_cache_values_per_token"]
    row = next(row for row in report["table"] if row["metric"] == "kv_cache_bytes_per_token")
    assert row["dtype"] == "bfloat16" and source["measurements"]["kv_cache_dtype"] == "float32"
    assert row["deltas"][converted["name"]]["ratio"] == values == 20 / 64
    assert "| model | kv_cache_bytes_per_token (bfloat16) |" in stdout and "(×0.3125) |" in stdout, stdout


# ---- recover: damaged checkpoints, fallback, a kill -9 inside a save, full disks --------------------------------------

# no held-out rows: the runs below resume step by step, and evaluation would only slow them
RUN_FLAGS = ["--seq-len", "32", "--batch-size", "2", "--lora-rank", "4", "--lr", "5e-3", "--eval-sequences", "0",
             "--eval-every", "0", "--no-progress", "--max-steps", "6", "--save-every", "2", "--keep-checkpoints", "2"]


@pytest.fixture(scope="module")
def unfinished_run(tiny_mla, tmp_path_factory) -> tuple[Path, Path]:
    """(training text, a recover run folder with checkpoints step-000002 and step-000004 and no model yet): a run
    stopped before its export."""
    from mha2mla.train.loop import RecoveryRun

    base = tmp_path_factory.mktemp("run")
    (base / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecoveryRun, "export", lambda self, report: None)
        code, _, err = run_cli(["recover", tiny_mla, "--data", base / "corpus.txt", "--out", base / "run", *RUN_FLAGS],
                               _NoCapture())
    assert code == 0, err
    assert sorted(p.name for p in (base / "run" / "checkpoints").glob("step-*")) == ["step-000002", "step-000004"]
    return base / "corpus.txt", base / "run"


class _NoCapture:
    """capsys for run_cli outside a test (a module fixture): nothing to read."""

    def readouterr(self):
        return type("Captured", (), {"out": "", "err": ""})()


class _Payload:
    def __reduce__(self):  # what a malicious rng_state_0.pt would run; weights_only must refuse it unrun
        return (os.getcwd, ())


def _damage(run: Path, what: str) -> str:
    """Damage the newest checkpoint as a kill -9 or a bad disk would; the file the sentence must name."""
    import pickle

    step = run / "checkpoints" / "step-000004"
    if what == "optimizer_truncated":
        data = (step / "optimizer.pt").read_bytes()
        (step / "optimizer.pt").write_bytes(data[: len(data) // 2])
        return "optimizer.pt"
    if what == "optimizer_deleted":
        (step / "optimizer.pt").unlink()
        return "optimizer.pt is missing"
    if what == "trainable_garbage":
        (step / "trainable.safetensors").write_bytes(b"\x13garbage" * 100)
        return "trainable.safetensors"
    if what == "trainer_state_garbage":
        (step / "trainer_state.json").write_text("{\"step\": 4, ")
        return "trainer_state.json"
    (step / "rng_state_0.pt").write_bytes(pickle.dumps(_Payload()))
    return "rng_state_0.pt"


DAMAGE = ["optimizer_truncated", "optimizer_deleted", "trainable_garbage", "trainer_state_garbage", "rng_pickle_payload"]


def _run_copy(unfinished_run, tmp_path: Path) -> tuple[Path, Path]:
    corpus, run = unfinished_run
    return corpus, _copy(run, tmp_path / "run")


@pytest.mark.parametrize("what", DAMAGE)
def test_resuming_a_damaged_checkpoint_names_it(what, unfinished_run, tiny_mla, tmp_path, capsys, monkeypatch,
                                                stderr_logging):
    corpus, run = _run_copy(unfinished_run, tmp_path)
    needle = _damage(run, what)
    args = ["recover", tiny_mla, "--data", corpus, "--out", run, *RUN_FLAGS, "--resume", run / "checkpoints" / "step-000004"]
    _refused(args, None, needle, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("what", DAMAGE)
def test_resume_auto_falls_back_to_the_newest_complete_checkpoint(what, unfinished_run, tiny_mla, tmp_path, capsys,
                                                                  stderr_logging):
    corpus, run = _run_copy(unfinished_run, tmp_path)
    needle = _damage(run, what)
    code, _, err = run_cli(["recover", tiny_mla, "--data", corpus, "--out", run, *RUN_FLAGS, "--resume", "auto"], capsys)
    assert code == 0 and "Traceback" not in err, err
    warning = next(line for line in err.splitlines() if "is damaged" in line)
    assert "step-000004" in warning and needle in warning and warning.endswith("resuming from step-000002 instead.")
    report = json.loads((run / "recovery_report.json").read_text())
    assert report["steps"] == 6 and Path(report["resumed_from"]).name == "step-000002"


def test_resume_auto_with_every_checkpoint_damaged(unfinished_run, tiny_mla, tmp_path, capsys, monkeypatch,
                                                   stderr_logging):
    corpus, run = _run_copy(unfinished_run, tmp_path)
    for step in ("step-000002", "step-000004"):
        (run / "checkpoints" / step / "optimizer.pt").write_bytes(b"")
    args = ["recover", tiny_mla, "--data", corpus, "--out", run, *RUN_FLAGS, "--resume", "auto"]
    _refused(args, None, "every checkpoint in", tmp_path, capsys, monkeypatch)


def test_resume_with_damaged_run_settings(unfinished_run, tiny_mla, tmp_path, capsys, monkeypatch, stderr_logging):
    corpus, run = _run_copy(unfinished_run, tmp_path)
    (run / "recover_config.json").write_text("\0\0garbage")
    args = ["recover", tiny_mla, "--data", corpus, "--out", run, *RUN_FLAGS, "--resume", "auto"]
    _refused(args, None, "recover_config.json is damaged", tmp_path, capsys, monkeypatch)


def test_kill_9_inside_a_checkpoint_save_then_resume_auto(unfinished_run, tiny_mla, tmp_path):
    """The run is held inside its step-4 save (tests/train/hold_save.py, half its files written) and killed there:
    step 2 stays complete, and --resume auto finishes the run from it."""
    from mha2mla.train.state.checkpoint import load_checkpoint

    corpus, _ = unfinished_run
    run = tmp_path / "run"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "mha2mla.cli.main", "recover", str(tiny_mla), "--data", str(corpus), "--out",
               str(run), *RUN_FLAGS]
    held = [sys.executable, str(repo / "tests" / "train" / "hold_save.py"), "4", *command[3:]]
    process = subprocess.Popen(held, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not list(run.glob("checkpoints/.step-000004.mha2mla-tmp.*/HELD")) and process.poll() is None:
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -9, "the run ended before it reached its step-4 save"
    assert not (run / "checkpoints" / "step-000004").exists()
    assert load_checkpoint(run / "checkpoints" / "step-000002")["state"]["step"] == 2  # every file of the previous one reads back

    resumed = subprocess.run([*command, "--resume", "auto"], env=env, capture_output=True, text=True, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((run / "recovery_report.json").read_text())
    assert report["steps"] == 6 and Path(report["resumed_from"]).name == "step-000002"
    assert not [p.name for p in run.iterdir() if ".mha2mla-" in p.name]  # the killed save's staging folder is gone


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_recover_checkpoint_save_on_a_full_disk(tiny_mla, tmp_path, capsys, monkeypatch, stderr_logging):
    import mha2mla.train.state.checkpoint

    (tmp_path / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    monkeypatch.setattr(mha2mla.train.state.checkpoint, "_write_synced", _full_disk)
    run = tmp_path / "run"
    code, _, err = run_cli(["recover", tiny_mla, "--data", tmp_path / "corpus.txt", "--out", run, *RUN_FLAGS], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("error: could not write"), err
    assert "No space left on device" in lines[-1] and "step-000002" in lines[-1]
    assert sorted(p.name for p in run.iterdir()) == [".mha2mla_files", "recover_config.json", "train_log.jsonl"]  # no staging folder


def test_recover_export_on_a_full_disk(tiny_mla, tmp_path, capsys, monkeypatch, stderr_logging):
    import mha2mla.train.model.merge

    def full_while_writing(folder, *args, **kwargs):  # safetensors reports a full disk only in its message
        (Path(folder) / "absorbed.safetensors").write_bytes(b"\0" * 64)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    (tmp_path / "corpus.txt").write_text(SAMPLE_TEXT * 4)
    monkeypatch.setattr(mha2mla.train.model.merge, "write_absorbed", full_while_writing)
    run = tmp_path / "run"
    code, _, err = run_cli(["recover", tiny_mla, "--data", tmp_path / "corpus.txt", "--out", run, *RUN_FLAGS], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("error: could not write"), err
    assert "No space left on device" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "run"]  # no staging folder beside the run
    assert not (run / "config.json").exists() and (run / "checkpoints" / "step-000004").is_dir()  # kept


@pytest.mark.parametrize("text", ["recover:\n  data: [a, b\n", "source: x\n  bad: indent\n", "key: 'unclosed\n"])
def test_yaml_error_is_one_sentence(text, tmp_path):
    import yaml

    from mha2mla.io.recipe_errors import yaml_error_sentence

    with pytest.raises(yaml.YAMLError) as error:
        yaml.safe_load(text)
    sentence = yaml_error_sentence(tmp_path / "r.yaml", error.value)
    assert "\n" not in sentence and re.search(r"is not valid YAML \(line \d+, column \d+: \w", sentence), sentence


def test_convert_recipe_that_is_not_yaml(llama_source, tmp_path, capsys, monkeypatch, stderr_logging):
    (tmp_path / "recipe.yaml").write_text("source: x\nconvert:\n  kv_budget: [0.25\n  dtype: bfloat16\n")
    _refused(["convert", llama_source, tmp_path / "out", "--recipe", tmp_path / "recipe.yaml"], None, "not valid YAML (line",
             tmp_path, capsys, monkeypatch)
