"""Hostile inputs from the command line (docs/reliability.md): recipes of the wrong shape, prompts that are not UTF-8,
seeds outside the range every command takes, a damaged absorbed.json, and a source config.json with impossible head
counts. Each is refused with exactly one ``error:`` line, a non-zero exit, no traceback, and every file as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from common import build_source, run_cli, snapshot, tiny_tokenizer
from safetensors.torch import load_file, save_file

from mha2mla.compute import MAX_SEED


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A conversion of the tiny source (weight-only, fast): the model generate, eval and recover are given."""
    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    base = tmp_path_factory.mktemp("hostile")
    source = build_source(base / "src", "llama", num_heads=4, num_kv_heads=2, with_tokenizer=False)
    tiny_tokenizer(384).save_pretrained(source)
    out = base / "mla"
    convert(source, out, ConvertConfig(calib="none"), progress=False)
    return out


def _refused(args, needle: str, *roots: Path, capsys) -> str:
    """Run ``mha2mla ARGS``: non-zero exit, one ``error:`` line holding ``needle``, no traceback, ``roots`` unchanged."""
    before = [snapshot(root) for root in roots]
    code, _, err = run_cli(args, capsys)
    lines = err.strip().splitlines()
    assert code != 0, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert [snapshot(root) for root in roots] == before
    return lines[0]


# ---- recipes: (recipe text, words of the sentence) ------------------------------------------------------------------
RECIPES = {
    "source_a_number": ("source: 42\n", "`source:` must be text naming the model (a hub id, a folder or a .gguf file), "
                                        "not the number 42"),
    "source_a_list": ("source: [src]\n", "`source:` must be text naming the model"),
    "source_a_date": ("source: 2024-01-01\n", "not the date 2024-01-01; quote it if it is a name"),
    "source_empty": ('source: ""\n', "`source:` is empty"),
    "key_a_number": ("1: 2\n", "has an unknown top-level setting 1;"),
    "keys_a_number_and_text": ("1: 2\nfoo: 3\n", "has an unknown top-level setting"),
    "section_key_a_number": ("convert:\n  1: 2\n", "has an unknown convert setting '1'"),
    "empty_file": ("", "is empty; give `source:` and a section per command"),
    "only_comments": ("# mha2mla convert --recipe r.yaml out\n", "is empty"),
    "empty_mapping": ("{}\n", "is empty"),
    "anchor_inside_itself": ("convert: &a\n  calib: *a\n", "expands to more than 100,000 values"),
    "nested_too_deeply": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
}


@pytest.mark.parametrize("command", ["convert", "recover", "eval", "generate"])
@pytest.mark.parametrize("case", list(RECIPES))
def test_a_recipe_of_the_wrong_shape_is_one_sentence(case, command, converted, tmp_path, capsys, stderr_logging):
    text, needle = RECIPES[case]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    args = {"convert": ["convert", "--recipe", recipe, tmp_path / "out"],
            "recover": ["recover", converted, "--recipe", recipe, "--out", tmp_path / "run"],
            "eval": ["eval", converted, "--recipe", recipe, "--out", tmp_path / "eval"],
            "generate": ["generate", converted, "--recipe", recipe, "-p", "the"]}[command]
    line = _refused(args, needle, tmp_path, converted, capsys=capsys)
    assert str(recipe) in line


def test_a_recipe_with_a_source_and_only_out_converts(llama_source, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"source: {llama_source}\nconvert:\n  calib: none\n")
    code, _, err = run_cli(["convert", "--recipe", recipe, tmp_path / "out", "--no-progress"], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


# ---- generate --prompt with bytes that are not UTF-8 (a shell's $'\xff\xfe': surrogate escapes in sys.argv) --------
@pytest.mark.parametrize("prompts, needle", [
    (["\udcff\udcfe"], "invalid --prompt: the prompt holds bytes that are not UTF-8 (0xff 0xfe at character 1)"),
    (["fine", "caf\udce9"], "invalid --prompt: prompt 2 holds bytes that are not UTF-8 (0xe9 at character 4)"),
])
def test_generate_prompt_that_is_not_utf8(prompts, needle, converted, tmp_path, capsys, stderr_logging):
    args = ["generate", converted] + [part for prompt in prompts for part in ("-p", prompt)]
    _refused(args, needle, tmp_path, converted, capsys=capsys)


# ---- seeds outside 0..2**32-1, the range numpy, torch and random all take -------------------------------------------
@pytest.mark.parametrize("seed, needle", [
    ("99999999999999999999999", f"invalid --seed: input should be less than or equal to {MAX_SEED}"),
    (str(MAX_SEED + 1), f"invalid --seed: input should be less than or equal to {MAX_SEED}"),
    ("-1", "invalid --seed: input should be greater than or equal to 0"),
])
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_seed_out_of_range(command, seed, needle, converted, tmp_path, capsys, stderr_logging):
    args = {"generate": ["generate", converted, "-p", "the", "--temperature", "1", "--seed", seed],
            "eval": ["eval", converted, "--seed", seed, "--out", tmp_path / "eval"]}[command]
    _refused(args, needle, tmp_path, converted, capsys=capsys)


def test_seed_out_of_range_in_a_recipe_names_the_recipe(converted, tmp_path, capsys, stderr_logging):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("generate:\n  seed: 99999999999999999999999\n")
    _refused(["generate", converted, "--recipe", recipe, "-p", "the"],
             f"invalid `seed` under `generate:` in {recipe}: input should be less than or equal to {MAX_SEED}",
             tmp_path, converted, capsys=capsys)


def test_the_largest_seed_samples(converted, capsys):
    args = ["generate", converted, "-p", "the", "-n", "4", "--ignore-eos", "--temperature", "1", "--seed", MAX_SEED]
    first, again = run_cli(args, capsys), run_cli(args, capsys)
    assert first[0] == 0 and first == again, first


# ---- a damaged absorbed.json (or absorbed.safetensors) beside a converted model --------------------------------------
def _index(converted: Path) -> dict:
    return json.loads((converted / "absorbed.json").read_text())


ABSORBED = {
    "invalid_json": (lambda c: b'{"format": "mha2mla-absorbed",', "absorbed.json is damaged (not valid JSON"),
    "not_utf8": (lambda c: b"\xff\xfe{}", "absorbed.json is damaged (not UTF-8 text)"),
    "empty": (lambda c: b"", "absorbed.json is damaged (not valid JSON"),
    "a_list": (lambda c: b"[1, 2]", "absorbed.json is damaged (a JSON list, not an object)"),
    "wrong_format": (lambda c: json.dumps({**_index(c), "format": "other"}).encode(), "its format is 'other'"),
    "missing_key": (lambda c: json.dumps({k: v for k, v in _index(c).items() if k != "kv_lora_rank"}).encode(),
                    "absorbed.json is damaged (it lacks kv_lora_rank)"),
    "wrong_type": (lambda c: json.dumps({**_index(c), "num_hidden_layers": "2"}).encode(),
                   "absorbed.json is damaged (num_hidden_layers is '2', not a positive whole number)"),
    "boolean": (lambda c: json.dumps({**_index(c), "v_head_dim": True}).encode(), "v_head_dim is True"),
}


@pytest.mark.parametrize("case", list(ABSORBED))
def test_damaged_absorbed_index(case, converted, tmp_path, capsys, stderr_logging):
    model = shutil.copytree(converted, tmp_path / "model")
    content, needle = ABSORBED[case]
    (model / "absorbed.json").write_bytes(content(converted))
    line = _refused(["generate", model, "-p", "the"], needle, tmp_path, converted, capsys=capsys)
    assert "re-run the `mha2mla convert`" in line and str(model / "absorbed.json") in line


def test_absorbed_weights_missing_a_layer(converted, tmp_path, capsys, stderr_logging):
    model = shutil.copytree(converted, tmp_path / "model")
    tensors = load_file(str(model / "absorbed.safetensors"))
    del tensors["layers.1.w_uv"]
    save_file(tensors, str(model / "absorbed.safetensors"), metadata={"format": "mha2mla-absorbed"})
    _refused(["generate", model, "-p", "the"], "absorbed.safetensors is damaged (it lacks layers.1.w_uv)", tmp_path,
             converted, capsys=capsys)


# ---- a source config.json with impossible sizes ------------------------------------------------------------------
DIVISOR = "which is invalid: it must be a positive divisor of num_attention_heads (4)"
WHOLE = "which is invalid: it must be a positive whole number"
CONFIGS = {
    "kv_heads_zero": ({"num_key_value_heads": 0}, f"num_key_value_heads 0, {DIVISOR}"),
    "kv_heads_negative": ({"num_key_value_heads": -2}, f"num_key_value_heads -2, {DIVISOR}"),
    "kv_heads_fraction": ({"num_key_value_heads": 1.5}, f"num_key_value_heads 1.5, {DIVISOR}"),
    "kv_heads_text": ({"num_key_value_heads": "2"}, f'num_key_value_heads "2", {DIVISOR}'),
    "kv_heads_boolean": ({"num_key_value_heads": True}, f"num_key_value_heads true, {DIVISOR}"),
    "kv_heads_not_a_divisor": ({"num_key_value_heads": 3}, f"num_key_value_heads 3, {DIVISOR}"),
    "heads_zero": ({"num_attention_heads": 0}, f"num_attention_heads 0, {WHOLE}"),
    "heads_negative": ({"num_attention_heads": -4}, f"num_attention_heads -4, {WHOLE}"),
    "heads_fraction": ({"num_attention_heads": 4.5}, f"num_attention_heads 4.5, {WHOLE}"),
    "head_dim_zero": ({"head_dim": 0}, f"head_dim 0, {WHOLE}"),
    "layers_negative": ({"num_hidden_layers": -1}, f"num_hidden_layers -1, {WHOLE}"),
    "rope_theta_text": ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, 'rope_theta "abc"'),
    "rope_parameters_a_list": ({"rope_parameters": [1]}, "rope_parameters is a list, not a mapping"),
    "architectures_a_number": ({"architectures": 5}, "architectures 5, which is invalid: it must be a list"),
    "model_type_a_list": ({"model_type": [1]}, "model_type [1], which is invalid"),
}


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_source_config_with_impossible_sizes(case, command, llama_source, tmp_path, capsys, stderr_logging):
    source = shutil.copytree(llama_source, tmp_path / "model")
    changes, needle = CONFIGS[case]
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **changes}))
    args = {"convert": ["convert", source, tmp_path / "out", "--calib", "none", "--no-progress"],
            "inspect": ["inspect", source]}[command]
    line = _refused(args, "error: the source config.json", tmp_path, capsys=capsys)
    assert needle in line, line


def test_architectures_given_as_one_name_converts(llama_source, tmp_path, capsys):
    source = shutil.copytree(llama_source, tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": "LlamaForCausalLM"}))
    code, _, err = run_cli(["convert", source, tmp_path / "out", "--calib", "none", "--no-progress"], capsys)
    assert code == 0, err
