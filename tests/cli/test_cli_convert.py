"""`mha2mla convert` / `inspect` from the command line, and bad input: one clear sentence, a
non-zero exit and no output folder left behind."""

from __future__ import annotations

import json
import re

import pytest
import torch
from common import build_source, run_cli
from safetensors.torch import load_file, save_file


def leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_convert_and_inspect(llama_source, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run_cli(["convert", llama_source, out, "--kv-budget", "0.25", "--no-progress"], capsys)
    assert code == 0 and "KV cache per token" in stdout
    assert "method: calibrated on the bundled sample, 256 x 256 tokens" in stdout  # the default is the best method
    assert "calibrated on the bundled sample" in (out / "README.md").read_text()
    assert (out / "config.json").exists()
    code, stdout, _ = run_cli(["inspect", llama_source, "--json"], capsys)
    info = json.loads(stdout)
    assert code == 0 and info["family"] == "llama" and info["kv_heads"] == 2 and info["attention"] == "GQA"
    code, stdout, _ = run_cli(["inspect", out], capsys)
    assert code == 0 and "deepseek_v3" in stdout


def test_weight_only_is_asked_for_and_says_so(llama_source, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["convert", llama_source, out, "--calib", "none", "--dry-run"], capsys)
    assert code == 0 and "method: weight-only" in stdout and "poor without `mha2mla recover`" in stdout
    assert "weight-only conversion" in err and not out.exists()


def test_help_lists_what_a_user_needs(capsys):
    code, stdout, _ = run_cli(["convert", "--help"], capsys)
    options = set(re.findall(r"^  (--[a-z][a-z-]*)", stdout, flags=re.MULTILINE))  # the option column only
    assert code == 0 and len(options - {"--no-progress"}) <= 15, sorted(options)
    assert {"--kv-budget", "--profile", "--calib", "--calib-samples", "--calib-device", "--compute-dtype", "--recipe",
            "--dry-run", "--force"} <= options


def test_recipe_sets_options_and_rejects_unknown_keys(llama_source, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"source: {llama_source}\nconvert:\n  profile: exact\n  kv_lora_rank: 17\n  rope_dim: 8\n")
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", out, "--recipe", recipe, "--no-progress"], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["kv_lora_rank"] == 17 and config["qk_rope_head_dim"] == 8 and config["attention_bias"]
    recipe.write_text("convert:\n  kv_lora_rnk: 17\n")
    code, _, err = run_cli(["convert", llama_source, tmp_path / "out2", "--recipe", recipe], capsys)
    assert code == 2 and "kv_lora_rnk" in err and not (tmp_path / "out2").exists()


def _assert_clean_failure(code, err, out, needle):
    assert code != 0
    message = err.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("error: "), err
    assert needle in message[0]
    assert "Traceback" not in err
    assert not out.exists()
    assert leftovers(out.parent) == []


def test_unknown_architecture(tmp_path, capsys):
    src = build_source(tmp_path / "gpt2ish", "llama")
    config = json.loads((src / "config.json").read_text())
    config["architectures"], config["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", src, out], capsys)
    _assert_clean_failure(code, err, out, "LlamaForCausalLM")


def test_missing_weights(tmp_path, capsys):
    src = build_source(tmp_path / "src", "llama")
    (src / "model.safetensors").unlink()
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", src, out], capsys)
    _assert_clean_failure(code, err, out, "model.safetensors")


def test_truncated_weights(tmp_path, capsys):
    src = build_source(tmp_path / "src", "llama")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 5000])
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", src, out], capsys)
    _assert_clean_failure(code, err, out, "truncated")


@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size"])
def test_config_missing_a_key(tmp_path, capsys, key):
    src = build_source(tmp_path / "src", "llama")
    config = json.loads((src / "config.json").read_text())
    del config[key]
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", src, out, "--no-progress"], capsys)
    _assert_clean_failure(code, err, out, key)


def test_copied_tensor_with_the_wrong_shape(tmp_path, capsys):
    """An MLP tensor is copied as it is: a shape that disagrees with config.json used to give a checkpoint
    that transformers refuses to load."""
    src = build_source(tmp_path / "src", "llama")
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-8].contiguous()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", src, out, "--no-progress", "--calib", "none"], capsys)
    _assert_clean_failure(code, err, out, "down_proj")


def test_nan_weights(tmp_path, capsys):
    src = build_source(tmp_path / "src", "llama")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", src, out, "--no-progress"], capsys)
    _assert_clean_failure(code, err, out, "NaN")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--kv-budget", "0.03"], "raise --kv-budget"),  # 2 values/token/layer: nothing beside the rope dims
        (["--kv-lora-rank", "8", "--rope-dim", "7"], "--rope-dim"),
        (["--kv-lora-rank", "8", "--rope-dim", "32"], "--rope-dim"),
        (["--kv-budget", "0.25", "--kv-lora-rank", "8", "--rope-dim", "8"], "not both"),
        (["--kv-lora-rank", "8"], "--rope-dim"),
        (["--kv-lora-rank", "100000000", "--rope-dim", "8"], "more than a layer can use"),
        (["--kv-budget", "1.5"], "invalid --kv-budget: must be a fraction in (0, 1]."),
        (["--profile", "fast"], "profile"),
    ],
)
def test_bad_sizes(llama_source, tmp_path, capsys, args, needle):
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", llama_source, out, *args], capsys)
    _assert_clean_failure(code, err, out, needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--calib", "none", "--calib-samples", "8"], "so calib_samples (--calib-samples) contradicts it"),
        (["--calib", "none", "--reconstruct"], "so reconstruct (--reconstruct) contradicts it"),
        (["--calib", "NONE", "--calib-device", "cpu"], "so calib_device (--calib-device) contradicts it"),
    ],
)
def test_weight_only_refuses_calibration_settings(llama_source, tmp_path, capsys, args, needle):
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", llama_source, out, *args], capsys)
    assert code == 2
    _assert_clean_failure(code, err, out, needle)


def test_weight_only_contradicted_by_the_recipe_names_the_recipe_key(llama_source, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("convert:\n  calib_samples: 8\n")
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", llama_source, out, "--recipe", recipe, "--calib", "none"], capsys)
    _assert_clean_failure(code, err, out, "calib_samples")
    code, _, err = run_cli(["convert", llama_source, out, "--recipe", recipe, "--calib", "none", "--dry-run"], capsys)
    assert code == 2  # a dry run is refused the same way


def test_out_inside_the_source_folder_is_refused(llama_source, tmp_path, capsys):
    before = sorted(p.name for p in llama_source.iterdir())
    code, _, err = run_cli(["convert", llama_source, llama_source / "mla", "--calib", "none", "--no-progress"], capsys)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "inside the source model" in err
    assert sorted(p.name for p in llama_source.iterdir()) == before


def test_existing_out_is_refused_without_force(llama_source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(["convert", llama_source, out, "--no-progress"], capsys)
    assert code != 0 and "--force" in err and (out / "keep.txt").read_text() == "mine"
    code, _, err = run_cli(["convert", llama_source, out, "--no-progress", "--force"], capsys)
    assert code == 2 and "not written by mha2mla" in err and (out / "keep.txt").read_text() == "mine"


def test_missing_source(tmp_path, capsys):
    code, _, err = run_cli(["convert", tmp_path / "nope", tmp_path / "out"], capsys)
    assert code != 0 and "does not exist" in err and not (tmp_path / "out").exists()


def test_version(capsys):
    code, stdout, _ = run_cli(["--version"], capsys)
    assert code == 0 and "mha2mla" in stdout
    assert torch.__version__
