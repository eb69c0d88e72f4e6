"""The one causal-LM loader (mha2mla/io/loader.py): a model folder in the dtype asked for (a name or a torch dtype),
a converted MLA model on the padded SDPA attention, and every argument that cannot be a causal LM refused in one
sentence before anything loads. (The .gguf path is exercised through ``eval``'s loader in tests/cli/test_cli_output.py.)"""

from __future__ import annotations

import pytest
import torch

from mha2mla import UserError
from mha2mla.io.loader import gguf_dtype, load_causal_lm, load_tokenizer, resolve_dtype


@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                 (torch.float16, torch.float16), ("auto", torch.float32)])
def test_a_folder_loads_in_the_dtype_asked_for(llama_source, dtype, expected):
    model = load_causal_lm(llama_source, dtype)
    assert next(model.parameters()).dtype == expected  # auto: the float32 the folder was saved in
    assert model.config._attn_implementation == "sdpa"  # transformers' default for a Llama


def test_a_converted_model_runs_the_padded_sdpa_and_an_explicit_choice_is_kept(tiny_mla):
    assert load_causal_lm(tiny_mla, "float32").config._attn_implementation == "mha2mla_sdpa"
    assert load_causal_lm(tiny_mla, "float32", "sdpa").config._attn_implementation == "mha2mla_sdpa"
    assert load_causal_lm(tiny_mla, "float32", "eager").config._attn_implementation == "eager"


def test_the_tokenizer_of_a_folder_loads(llama_source):
    assert load_tokenizer(llama_source)("a b")["input_ids"]


def test_dtype_names():
    assert resolve_dtype(None) == "auto" and resolve_dtype("bfloat16") is torch.bfloat16
    assert gguf_dtype("auto") is torch.bfloat16 and gguf_dtype("float32") is torch.float32
    with pytest.raises(UserError, match="unknown dtype 'float8'; choose auto, float32"):
        resolve_dtype("float8")


def _masked_lm(folder):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
                    ).save_pretrained(folder)
    return folder


def _damaged(folder, llama_source):
    import shutil

    shutil.copytree(llama_source, folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    return folder


@pytest.mark.parametrize(("make", "sentence"), [
    (lambda tmp, src: tmp / "missing", "does not exist; pass a model folder, a .gguf file or a hub id"),
    (lambda tmp, src: (tmp / "notes.txt").write_text("x") and tmp / "notes.txt", "is a file but not a .gguf"),
    (lambda tmp, src: _masked_lm(tmp / "bert"), "BertForMaskedLM), not a causal language model"),
    (lambda tmp, src: _damaged(tmp / "cut", src), "is damaged"),
    (lambda tmp, src: (tmp / "empty").mkdir() or tmp / "empty", "has no config.json"),
])
def test_what_is_not_a_causal_lm_is_one_sentence(tmp_path, llama_source, make, sentence):
    spec = make(tmp_path, llama_source)
    with pytest.raises(UserError) as caught:
        load_causal_lm(spec, "float32")
    message = str(caught.value)
    assert sentence in message and "\n" not in message


def test_a_folder_without_a_tokenizer_is_one_sentence_with_the_hint(tmp_path):
    from common import build_source

    folder = build_source(tmp_path / "bare", with_tokenizer=False)
    with pytest.raises(UserError, match="cannot load a tokenizer from .*; copy the tokenizer files"):
        load_tokenizer(folder, hint="copy the tokenizer files")


def test_a_hub_id_offline_without_a_cached_copy_is_one_sentence(tmp_path, monkeypatch, capsys):
    from common import run_cli, snapshot
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run_cli(["eval", "nosuch-owner/nosuch-model", "--tasks", "mmlu_dev_mc"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: nosuch-owner/nosuch-model is not a local path"), err
    assert "offline" in lines[0] and "pass a model folder or a .gguf file" in lines[0]
    assert snapshot(tmp_path) == before
