"""Targets: shapes each engine's fast kernels accept, the engine checker, exact value-head padding, and
the files engines glob (docs/engines.md)."""

from __future__ import annotations

import json

import pytest
import torch
from common import build_source, logits

from mha2mla import UserError
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert
from mha2mla.convert.plan.engines import engine_violations
from mha2mla.convert.plan.resolve import make_plan
from mha2mla.families import family_for_config

# what a SmolLM2-135M conversion at 31.25% wrote before targets existed (kv_lora_rank 88, rope 32, nope = v = 64)
SMOLLM2_OUTPUT = {
    "model_type": "deepseek_v3", "kv_lora_rank": 88, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
    "num_attention_heads": 9, "num_key_value_heads": 9,
}
SMOLLM2_FILES = ["absorbed.json", "absorbed.safetensors", "config.json", "model.safetensors"]
SMOLLM2_SOURCE = {  # its source config: Llama GQA, head dim 64
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
    "rope_theta": 100000.0, "hidden_act": "silu",
}


@pytest.fixture(scope="module")
def head128(tmp_path_factory):
    """A Llama-like source with head dim 128 (as Llama, Mistral, Qwen2.5-7B): 512 KV values per token per layer."""
    return build_source(tmp_path_factory.mktemp("head128") / "src", "llama", num_heads=4, num_kv_heads=2, head_dim=128,
                        hidden_size=256)


@pytest.fixture(scope="module")
def head64(tmp_path_factory):
    return build_source(tmp_path_factory.mktemp("head64") / "src", "llama", num_heads=4, num_kv_heads=2, head_dim=64,
                        hidden_size=256)


def test_the_checker_names_each_engine_rule_todays_smollm2_output_breaks():
    vllm = engine_violations("vllm", SMOLLM2_OUTPUT, SMOLLM2_FILES)
    assert any("kv_lora_rank + qk_rope_head_dim only in [320, 512, 576], not 120" in p for p in vllm)
    assert any("(qk_nope, qk_rope, v) head dims only in" in p and "(64, 32, 64)" in p for p in vllm)
    assert any("would load absorbed.safetensors as model weights" in p for p in vllm)
    sglang = engine_violations("sglang", SMOLLM2_OUTPUT, SMOLLM2_FILES)
    assert any("moe_layer_freq" in p for p in sglang)
    assert any("multiple of 128" in p for p in sglang) and any("qk_rope_head_dim in [64]" in p for p in sglang)
    assert engine_violations("transformers", SMOLLM2_OUTPUT, SMOLLM2_FILES) == []


def test_a_source_that_cannot_reach_an_accepted_shape_under_the_budget_says_what_it_needs():
    family = family_for_config(SMOLLM2_SOURCE)
    with pytest.raises(UserError, match=r"at least 320 values per token per layer .*83\.3% .*--kv-budget 0\.8333"):
        make_plan(SMOLLM2_SOURCE, family, ConvertConfig(kv_budget=0.3125, target="vllm"))
    plan = make_plan(SMOLLM2_SOURCE, family, ConvertConfig(kv_budget=0.3125, target="llama.cpp"))
    assert (plan.kv_lora_rank, plan.rope_dim, plan.v_head_dim) == (88, 32, 64)  # llama.cpp takes any shape


@pytest.mark.parametrize("target, budget, expected", [
    ("vllm", 0.625, (256, 64, 128)),  # 320 values: kv_lora_rank 256 + rope 64
    ("vllm", 0.7, (256, 64, 128)),  # 358 values snap down to 320: a budget is a ceiling
    ("sglang", 0.75, (256, 64, 128)),  # multiples of 128 from 256; the latent here holds at most 256 + 1
])
def test_budgets_snap_to_shapes_the_engine_accepts(head128, target, budget, expected):
    config = json.loads((head128 / "config.json").read_text())
    plan = make_plan(config, family_for_config(config), ConvertConfig(kv_budget=budget, target=target))
    assert (plan.kv_lora_rank, plan.rope_dim, plan.v_head_dim) == expected
    assert plan.dtype == "bfloat16"  # what the GPU engines serve
    if round(budget * 512) != 320:
        assert any("snapped to 320" in warning for warning in plan.warnings)


def test_explicit_ranks_outside_the_engine_table_are_refused(head128):
    config = json.loads((head128 / "config.json").read_text())
    with pytest.raises(UserError, match="does not accept kv_lora_rank 200"):
        make_plan(config, family_for_config(config), ConvertConfig(kv_lora_rank=200, rope_dim=64, target="sglang"))
    with pytest.raises(UserError, match="qk_rope_head_dim 64"):
        make_plan(config, family_for_config(config), ConvertConfig(kv_lora_rank=256, rope_dim=32, target="vllm"))
    with pytest.raises(UserError, match="portable profile only"):
        make_plan(config, family_for_config(config), ConvertConfig(kv_budget=0.625, target="vllm", profile="exact"))


@pytest.mark.parametrize("target", ["vllm", "sglang"])
def test_target_outputs_of_a_head_dim_128_source_pass_the_engine_checker(head128, tmp_path, target):
    out = tmp_path / "out"
    result = convert(head128, out, ConvertConfig(kv_budget=0.625, target=target, calib_samples=4, calib_seq_len=32),
                     progress=False)
    config = json.loads((out / "config.json").read_text())
    files = sorted(path.name for path in out.iterdir())
    assert engine_violations(target, config, files) == []
    assert config["moe_layer_freq"] == 1 and config["mha2mla"]["target"] == target
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["v_head_dim"]) == (256, 64, 128)
    assert result.plan.calibrated and config["dtype"] == "bfloat16"
    assert torch.isfinite(logits(out, torch.arange(20).view(1, -1))).all()


def test_value_padding_is_exact(head64, tmp_path):
    """vLLM's prefill takes (64, 64, 128) heads: the head-dim-64 source's value heads are zero-padded to 128.
    The padded checkpoint computes exactly what the unpadded one does."""
    options = dict(kv_lora_rank=256, rope_dim=64, calib=None, dtype="float32")
    padded = convert(head64, tmp_path / "vllm", ConvertConfig(target="vllm", **options), progress=False)
    plain = convert(head64, tmp_path / "plain", ConvertConfig(target="transformers", **options), progress=False)
    assert padded.plan.v_head_dim == 128 and plain.plan.v_head_dim == 64
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["v_head_dim"] == 128
    tokens = torch.randint(0, 384, (2, 30), generator=torch.Generator().manual_seed(0))
    difference = (logits(tmp_path / "vllm", tokens) - logits(tmp_path / "plain", tokens)).abs().max().item()
    assert difference < 1e-4, difference  # float32 sums in another order; the ladder's bound


def test_a_single_shard_output_has_an_index_that_hides_the_absorbed_weights(head64, tmp_path):
    out = tmp_path / "out"
    convert(head64, out, ConvertConfig(calib=None, kv_budget=0.5), progress=False)
    assert (out / "model.safetensors").exists() and (out / "absorbed.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert not any(name.startswith("absorbed") for name in index["weight_map"])
