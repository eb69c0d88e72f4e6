"""The compute dtype of the latent-cache decode (docs/generate.md, "compute dtype"): decided once by the engine
through mha2mla.compute's policy; bf16 stays within bf16 tolerance of float32; bf16 weights on CPU are packed for
oneDNN without changing a number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import randomize_weights, run_cli, tiny_deepseek_config, tiny_tokenizer
from transformers import AutoModelForCausalLM

import mha2mla.compute
from mha2mla import UserError
from mha2mla.kernels.reference import latent_cache_decode_reference
from mha2mla.modeling.absorbed import write_absorbed
from mha2mla.modeling.generate import MLAEngine
from mha2mla.modeling.generate_config import GenerateConfig
from mha2mla.modeling.linear import linear, pack, packing_applies

PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11, 64], [9, 8], [120, 33, 200, 1, 77]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mla-compute-dtype")
    torch.manual_seed(0)
    config = tiny_deepseek_config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_weights(model)
    model.save_pretrained(folder)
    write_absorbed(folder, model.state_dict(), config)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("flags", "asked", "expected"), [
    ({"avx512_bf16"}, "auto", "bfloat16"),
    ({"amx_bf16"}, "auto", "bfloat16"),
    (set(), "auto", "float32"),
    ({"avx512_bf16"}, "float32", "float32"),
    (set(), "bfloat16", "bfloat16"),
])
def test_engine_resolves_the_compute_dtype_once_from_the_cpu(folder, monkeypatch, flags, asked, expected):
    monkeypatch.setattr(mha2mla.compute, "cpu_flags", lambda *args, **kwargs: set(flags))
    engine = MLAEngine.from_pretrained(folder, device="cpu", compute_dtype=asked, load_tokenizer=False)
    assert engine.compute_dtype == expected
    dtype = getattr(torch, expected)
    assert engine.model.dtype == dtype and engine.model.new_cache(1, 4).data.dtype == dtype
    assert engine.model.embed.dtype == dtype and engine.model.layers[0].o_proj.dtype == dtype


def test_unknown_compute_dtype_is_a_user_error(folder):
    with pytest.raises(UserError, match="not a compute dtype"):
        MLAEngine.from_pretrained(folder, compute_dtype="float16", load_tokenizer=False)


def test_bfloat16_decode_agrees_with_float32(folder):
    """bf16 tolerance on a tiny model whose logits are a few units: bf16 keeps 8 significant bits (a relative
    rounding of 2^-9 per operation), so logits move by about a tenth at most, the log-probability of float32's
    greedy token by a few hundredths, and the greedy choice agrees except at near ties (the bounds leave twice
    the movement seen on this model). The bf16 run is fed float32's tokens so that both score the same positions."""
    engines = {name: MLAEngine.from_pretrained(folder, compute_dtype=name, load_tokenizer=False)
               for name in ("float32", "bfloat16")}
    [reference] = engines["float32"].generate([PROMPTS[0]], max_new_tokens=32, eos_token_ids=[], return_logits=True)
    model = engines["bfloat16"].model
    cache = model.new_cache(1, len(PROMPTS[0]) + 32)
    steps = [model.prefill(cache, [PROMPTS[0]])]
    for token in reference.tokens[:-1]:
        steps.append(model.decode(cache, torch.tensor([token])))
    got = torch.cat(steps)  # (32, V)
    assert got.dtype == torch.float32
    expected = reference.logits
    assert expected.abs().max() > 2.0  # logits of several units, not near zero
    assert (got - expected).abs().max() < 0.25
    logprob_gap = (got.log_softmax(-1) - expected.log_softmax(-1)).gather(-1, expected.argmax(-1, keepdim=True))
    assert logprob_gap.abs().max() < 0.1
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_float32_is_not_packed_and_bfloat16_on_cpu_is(folder):
    engine_32 = MLAEngine.from_pretrained(folder, compute_dtype="float32", load_tokenizer=False)
    engine_16 = MLAEngine.from_pretrained(folder, compute_dtype="bfloat16", load_tokenizer=False)
    assert not engine_32.model.layers[0].gate_proj.is_mkldnn and not engine_32.model.lm_head.is_mkldnn
    packed = packing_applies(torch.device("cpu"), torch.bfloat16)
    assert engine_16.model.layers[0].gate_proj.is_mkldnn == packed and engine_16.model.lm_head.is_mkldnn == packed
    assert not engine_16.model.embed.is_mkldnn  # looked up by F.embedding, never packed


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_linear_is_f_linear_to_the_bit(rows):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    x = torch.randn(2, rows, 32, generator=generator).bfloat16()
    for b in (None, bias):
        assert torch.equal(linear(x, pack(weight), b), F.linear(x, weight, b))
        assert torch.equal(linear(x[0], pack(weight), b), F.linear(x[0], weight, b))


def test_reduced_precision_decode_attention_keeps_the_reference_numbers():
    """The bf16 branch of latent_cache_decode_reference (keys @ query^T) on a ragged batch: within bf16 rounding
    of the float32 branch, and masked rows past each length."""
    generator = torch.Generator().manual_seed(0)
    B, H, T, r, d_r = 3, 4, 50, 24, 8
    query = torch.randn(B, H, r + d_r, generator=generator)
    cache = torch.randn(B, T + 6, r + d_r, generator=generator)
    lengths = torch.tensor([T, 7, 31])
    expected = latent_cache_decode_reference(query, cache, lengths, T, r, 0.2)
    got = latent_cache_decode_reference(query.bfloat16(), cache.bfloat16(), lengths, T, r, 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=0)
    cache[1, 7:] = 1e4  # positions past row 1's length must not count
    again = latent_cache_decode_reference(query.bfloat16(), cache.bfloat16(), lengths, T, r, 0.2)
    assert torch.equal(again[1], got[1])


def test_generate_has_one_dtype_setting(folder, capsys):
    """compute_dtype is the decode's one dtype setting; the old `dtype` name is gone (refused as unknown)."""
    assert GenerateConfig(prompt="hi").compute_dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        GenerateConfig(prompt="hi", dtype="float32")
    code, _, err = run_cli(["generate", folder, "-p", "the", "--dtype", "float32"], capsys)
    assert code == 2 and "--dtype" in err and "Traceback" not in err
    code, out, err = run_cli(["generate", folder, "-p", "the latent ", "-n", "6", "--ignore-eos", "--compute-dtype",
                              "bfloat16"], capsys)
    assert code == 0 and out.strip(), err
