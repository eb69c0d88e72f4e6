"""The conversion: exactness ladder (docs/design.md §3), interleaved rope as serving engines apply it,
absorbed weights, cache size, the portable checker, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from common import build_source, logits
from transformers import AutoModelForCausalLM

from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.output.portable import check_portable_folder, portable_violations
from mha2mla.convert.pipeline import convert
from mha2mla.io.mla_checkpoint import load_absorbed
from mha2mla.io.model_folder import read_conversion_report
from mha2mla.modeling.reference import reference_attention

HEAD_DIM = 16
HIDDEN = 64
SMALL_CALIBRATION = {"calib_samples": 4, "calib_seq_len": 32}  # the calibrated default, on few tokens


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {
        "llama_mha": build_source(root / "llama_mha", "llama", num_heads=4, num_kv_heads=4),
        "llama_gqa": build_source(root / "llama_gqa", "llama", num_heads=4, num_kv_heads=2),
        "llama_mqa": build_source(root / "llama_mqa", "llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
        "qwen2_gqa": build_source(root / "qwen2_gqa", "qwen2", num_heads=4, num_kv_heads=2),
        "qwen2_mqa": build_source(root / "qwen2_mqa", "qwen2", num_heads=4, num_kv_heads=1),
        "mistral_gqa": build_source(root / "mistral_gqa", "mistral", num_heads=4, num_kv_heads=2),
    }


@pytest.fixture(scope="session")
def input_ids():
    return torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))


def full_capacity(num_kv_heads: int, profile: str) -> ConvertConfig:
    rank = min(HIDDEN, 2 * num_kv_heads * HEAD_DIM) + (1 if profile == "exact" else 0)
    return ConvertConfig(calib=None, profile=profile, kv_lora_rank=rank, rope_dim=HEAD_DIM)


# --- rung (a): MQA source, all pairs kept, full rank -> the source's logits ------------------------

@pytest.mark.parametrize("name", ["llama_mqa", "qwen2_mqa"])
def test_mqa_full_capacity_exact_profile_reproduces_source_logits(sources, input_ids, tmp_path, name):
    out = tmp_path / "out"
    convert(sources[name], out, full_capacity(1, "exact"), progress=False)
    difference = (logits(out, input_ids) - logits(sources[name], input_ids)).abs().max().item()
    assert difference < 1e-4, difference


def test_exact_profile_carries_qwen2_biases_through_q_lora_and_constant_channel(sources, tmp_path):
    out = tmp_path / "out"
    convert(sources["qwen2_mqa"], out, full_capacity(1, "exact"), progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is True and config["q_lora_rank"] == HIDDEN + 1
    assert config["kv_lora_rank"] == 2 * HEAD_DIM + 1  # latent + constant channel


# --- rung (b): full rank, exact rope part -> only the dropped rotations differ ---------------------

def test_gqa_with_rank_one_rope_keys_is_exact_at_full_capacity(tmp_path, input_ids):
    """If, at every pair, the KV heads' key components are proportional, head mixing puts all key
    energy on the shared rope key and no rotation is dropped: the conversion is exact."""
    source = build_source(tmp_path / "src", "llama", num_heads=4, num_kv_heads=2)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.k_proj.weight"
        k = tensors[name].view(2, HEAD_DIM, HIDDEN)
        k[1] = -0.7 * k[0]  # group 1's key = scaled group 0's at every pair
        tensors[name] = k.reshape(2 * HEAD_DIM, HIDDEN).contiguous()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    convert(source, out, full_capacity(2, "exact"), progress=False)
    difference = (logits(out, input_ids) - logits(source, input_ids)).abs().max().item()
    assert difference < 1e-4, difference


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa", "qwen2_gqa", "mistral_gqa"])
def test_full_capacity_differs_only_by_dropped_rotations(sources, tmp_path, name):
    """At a single position every rotation is the identity, so a full-capacity exact conversion
    must reproduce the source there, for any number of KV heads."""
    out = tmp_path / "out"
    num_kv = json.loads((sources[name] / "config.json").read_text())["num_key_value_heads"]
    convert(sources[name], out, full_capacity(num_kv, "exact"), progress=False)
    one_token = torch.arange(0, 384, 48).view(-1, 1)  # 8 sequences of length 1
    difference = (logits(out, one_token) - logits(sources[name], one_token)).abs().max().item()
    assert difference < 1e-4, difference


# --- rung (c): the error falls as the rank grows ---------------------------------------------------

@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_gqa"])
def test_error_falls_monotonically_with_rank(sources, input_ids, tmp_path, name):
    reference = logits(sources[name], input_ids)
    errors, k_errors = [], []
    for rank in (4, 12, 24, 40, 64):
        out = tmp_path / f"r{rank}"
        result = convert(sources[name], out, ConvertConfig(calib=None, profile="exact", kv_lora_rank=rank + 1, rope_dim=HEAD_DIM), progress=False)
        errors.append((logits(out, input_ids) - reference).pow(2).mean().sqrt().item())
        k_errors.append(sum(layer["k_rel_error"] + layer["v_rel_error"] for layer in result.report.layers))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert all(a > b for a, b in zip(k_errors, k_errors[1:])), k_errors


# --- rung (d) + serving-engine rope + absorbed weights --------------------------------------------

@pytest.mark.parametrize("profile", ["exact", "portable"])
@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa", "llama_mqa", "qwen2_gqa"])
def test_transformers_equals_own_interleaved_reference_and_absorbed_forward(sources, input_ids, tmp_path, name, profile):
    """Loaded with plain AutoModelForCausalLM (no remote code), the checkpoint's logits equal our own
    forward that applies rope GPT-J style on the interleaved rows (as vLLM / SGLang do), and the
    absorbed attention over the latent cache (absorbed.safetensors) gives the same logits again."""
    out = tmp_path / "out"
    convert(sources[name], out, ConvertConfig(calib=None, profile=profile, kv_budget=0.375), progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=False).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    _, absorbed = load_absorbed(out)
    with torch.no_grad():
        transformers_logits = model(input_ids).logits
        with reference_attention(model):
            own_logits = model(input_ids).logits
        with reference_attention(model, absorbed=True, absorbed_tensors=absorbed):
            absorbed_logits = model(input_ids).logits
    assert (transformers_logits - own_logits).abs().max().item() < 1e-4
    assert (transformers_logits - absorbed_logits).abs().max().item() < 1e-4


def test_half_split_rope_on_the_output_would_be_wrong(sources, input_ids, tmp_path):
    """Guard against a checkpoint that only works with rope_interleave: false: flipping the flag
    changes the logits, so the interleaved layout really is what the weights encode."""
    out = tmp_path / "out"
    convert(sources["llama_gqa"], out, ConvertConfig(calib=None, profile="portable", kv_budget=0.5), progress=False)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        good = model(input_ids).logits
        model.config.rope_interleave = False
        bad = model(input_ids).logits
    assert (good - bad).abs().max().item() > 1e-2


@pytest.mark.parametrize("profile", ["exact", "portable"])
def test_cache_holds_rank_plus_rope_values_per_token_per_layer(sources, tmp_path, profile):
    out = tmp_path / "out"
    result = convert(sources["llama_gqa"], out, ConvertConfig(profile=profile, kv_budget=0.25, **SMALL_CALIBRATION), progress=False)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = 17
    with torch.no_grad():
        cache = model(torch.arange(tokens).view(1, -1), use_cache=True).past_key_values
    values = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    plan = result.plan
    assert values == (plan.kv_lora_rank + plan.rope_dim) * tokens * 2  # 2 layers
    assert plan.kv_lora_rank + plan.rope_dim == round(0.25 * 2 * 2 * HEAD_DIM)


# --- the portable profile -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa", "llama_mqa", "qwen2_gqa", "mistral_gqa"])
def test_every_portable_output_passes_the_checker(sources, tmp_path, name):
    out = tmp_path / "out"
    result = convert(sources[name], out, ConvertConfig(kv_budget=0.25, **SMALL_CALIBRATION), progress=False)
    assert check_portable_folder(out) == []
    assert result.report.methods["lowrank"] == "attention" and result.report.methods["refit"]
    assert result.report.portable_check == "passed"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_interleave"] is True and config["attention_bias"] is False
    assert config["tie_word_embeddings"] is False  # engines load lm_head.weight explicitly


def _portable_config():
    return {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
        "hidden_act": "silu", "rope_interleave": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "first_k_dense_replace": 2,
        "num_nextn_predict_layers": 0,
    }


PORTABLE_NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]


@pytest.mark.parametrize(
    "change",
    [
        {"attention_bias": True},
        {"hidden_act": "gelu"},
        {"rope_interleave": False},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
        {"num_key_value_heads": 2},
        {"first_k_dense_replace": 1},
        {"num_nextn_predict_layers": 1},
        {"model_type": "llama"},
    ],
)
def test_checker_catches_each_config_violation(change):
    assert portable_violations(_portable_config(), PORTABLE_NAMES) == []
    assert len(portable_violations({**_portable_config(), **change}, PORTABLE_NAMES)) == 1


def test_checker_catches_attention_bias_tensors():
    names = PORTABLE_NAMES + ["model.layers.1.self_attn.kv_a_proj_with_mqa.bias"]
    problems = portable_violations(_portable_config(), names)
    assert len(problems) == 1 and "bias" in problems[0]


@pytest.mark.parametrize("profile", ["portable", "exact"])
def test_the_latent_is_written_balanced_against_the_layer_input_and_the_logits_are_unchanged(tmp_path, input_ids,
                                                                                           monkeypatch, profile):
    """A source whose layers read small hidden states (input norm weights of a few hundredths, as SmolLM2's): the
    portable latent norm is written at the input norm's scale (within the power of two the factor is rounded to)
    and the logits are exactly those of the layer written unbalanced; the exact profile's neutralised norm, which
    does not normalise, is written as it was."""
    import mha2mla.convert.pipeline as pipeline
    from mha2mla.modeling.rmsnorm import latent_scale_ratio

    source = build_source(tmp_path / "source", "llama", num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.mul_(0.03)
    model.save_pretrained(source)
    options = ConvertConfig(profile=profile, kv_budget=0.25, **SMALL_CALIBRATION)
    convert(source, tmp_path / "balanced", options, progress=False)
    monkeypatch.setattr(pipeline, "balance_latent", lambda tensors, *_: tensors)
    convert(source, tmp_path / "as_fitted", options, progress=False)
    balanced, as_fitted = (AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("balanced", "as_fitted"))
    for layer, before in zip(balanced.model.layers, as_fitted.model.layers):
        ratio = latent_scale_ratio(layer.self_attn.kv_a_layernorm.weight, layer.input_layernorm.weight)
        unbalanced = latent_scale_ratio(before.self_attn.kv_a_layernorm.weight, before.input_layernorm.weight)
        if profile == "portable":
            assert unbalanced > 8 and 2**-0.5 <= ratio <= 2**0.5, (unbalanced, ratio)
        else:
            assert torch.equal(layer.self_attn.kv_a_layernorm.weight, before.self_attn.kv_a_layernorm.weight)
    assert torch.equal(logits(tmp_path / "balanced", input_ids), logits(tmp_path / "as_fitted", input_ids))


# --- output layout --------------------------------------------------------------------------------

def test_output_folder_contents_and_sharding(sources, tmp_path, input_ids):
    out = tmp_path / "out"
    options = ConvertConfig(calib=None, profile="exact", kv_budget=0.5, max_shard_size=60_000)
    result = convert(sources["llama_gqa"], out, options, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / shard).exists() for shard in shards)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "README.md", "conversion_report.json",
                 "absorbed.safetensors", "absorbed.json"):
        assert (out / name).exists(), name
    report = json.loads((out / "conversion_report.json").read_text())
    assert len(report["layers"]) == 2
    assert {"kv_lora_rank", "rope_pairs", "k_rel_error", "v_rel_error"} <= set(report["layers"][0])
    assert report["kv_bytes_per_token"]["ratio"] == pytest.approx(0.5)
    assert "peak_gpu_gib" not in report  # calibrated on no GPU
    assert read_conversion_report(out).to_dict() == json.loads(json.dumps(result.report.to_dict()))  # back whole
    assert result.report.mean_errors()[0] == pytest.approx(sum(layer["k_rel_error"] for layer in report["layers"]) / 2)
    assert "kv_lora_rank" in (out / "README.md").read_text()
    assert not list(tmp_path.glob(".out.tmp-*"))
    # the sharded checkpoint equals an unsharded conversion
    single = tmp_path / "single"
    convert(sources["llama_gqa"], single, ConvertConfig(calib=None, profile="exact", kv_budget=0.5), progress=False)
    assert torch.equal(logits(out, input_ids), logits(single, input_ids))
    assert result.plan.kv_lora_rank == json.loads((out / "config.json").read_text())["kv_lora_rank"]


def test_kept_rope_pairs_map_exactly_onto_plain_rope(sources, tmp_path):
    """The kept pairs are the fastest ones, at base' = base^(d_r/d): the same frequencies exactly."""
    high = convert(sources["llama_mqa"], tmp_path / "high", ConvertConfig(calib=None, kv_lora_rank=32, rope_dim=8), progress=False)
    assert high.plan.rope_pairs == (0, 1, 2, 3)
    assert high.plan.target_rope_theta == pytest.approx(10000.0 ** (8 / HEAD_DIM))
    for j, pair in enumerate(high.plan.rope_pairs):
        assert math.isclose(high.plan.target_rope_theta ** (-2 * j / 8), 10000.0 ** (-2 * pair / HEAD_DIM), rel_tol=1e-9)


def test_every_other_rope_pair_is_kept_exactly_and_chosen_for_small_rope_keys(sources, tmp_path):
    """rope_stride s keeps pairs 0, s, 2s, … at base' = base^(s·d_r/d): the same frequencies exactly. The plan
    takes s = 2 when the rope key has at most a quarter of the rotating dims, and refuses a stride that runs
    past them."""
    from mha2mla import UserError

    source = sources["llama_mqa"]
    every_other = convert(source, tmp_path / "a", ConvertConfig(calib=None, kv_lora_rank=32, rope_dim=8, rope_stride=2),
                          dry_run=True)
    assert every_other.plan.rope_pairs == (0, 2, 4, 6)
    for j, pair in enumerate(every_other.plan.rope_pairs):
        assert math.isclose(every_other.plan.target_rope_theta ** (-2 * j / 8), 10000.0 ** (-2 * pair / HEAD_DIM), rel_tol=1e-9)
    assert convert(source, tmp_path / "b", ConvertConfig(calib=None, kv_lora_rank=32, rope_dim=4), dry_run=True).plan.rope_pairs == (0, 2)
    assert convert(source, tmp_path / "c", ConvertConfig(calib=None, kv_lora_rank=32, rope_dim=6), dry_run=True).plan.rope_pairs == (0, 1, 2)
    with pytest.raises(UserError, match="use a stride from 1 to 2"):
        convert(source, tmp_path / "d", ConvertConfig(calib=None, kv_lora_rank=32, rope_dim=8, rope_stride=3), dry_run=True)


def test_a_rope_stride_keeps_the_source_exact_where_the_skipped_pairs_carry_nothing(tmp_path, input_ids):
    """An MQA source whose keys are zero at the odd pairs, converted at full rank with rope 8 of 16 dims: every
    other pair (0, 2, 4, 6) keeps every rotation the source uses, so the logits are the source's; the four
    fastest pairs (0–3) drop the rotations of pairs 4 and 6, and are not."""
    from safetensors.torch import load_file, save_file

    source = build_source(tmp_path / "src", "llama", num_heads=4, num_kv_heads=1)
    tensors = load_file(str(source / "model.safetensors"))
    odd = [row for pair in range(1, HEAD_DIM // 2, 2) for row in (pair, pair + HEAD_DIM // 2)]  # half-split rows
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_proj.weight"][odd] = 0
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    errors = {}
    for stride in (2, 1):
        out = tmp_path / f"stride{stride}"
        convert(source, out, ConvertConfig(calib=None, profile="exact", kv_lora_rank=2 * HEAD_DIM + 1, rope_dim=8,
                                            rope_stride=stride), progress=False)
        errors[stride] = (logits(out, input_ids) - logits(source, input_ids)).abs().max().item()
    assert errors[2] < 1e-4, errors
    assert errors[1] > 1e-2, errors


def test_dry_run_writes_nothing(sources, tmp_path):
    out = tmp_path / "out"
    result = convert(sources["llama_gqa"], out, ConvertConfig(kv_budget=0.125), dry_run=True)
    assert not out.exists()
    assert result.plan.kv_lora_rank + result.plan.rope_dim == 8
    assert result.plan.calibrated and "calibrated on the bundled sample" in result.plan.method_summary()


def test_rank_above_what_a_layer_can_use_is_refused(sources, tmp_path):
    """An explicit rank beyond min(hidden, 2·G·d) would only add zero channels to the cache: refused,
    naming the full-capacity value (it used to be clamped into a cache larger than the source's)."""
    from mha2mla import UserError

    with pytest.raises(UserError, match=f"full-capacity value is {HIDDEN}"):
        convert(sources["llama_mha"], tmp_path / "out", ConvertConfig(calib=None, kv_lora_rank=500, rope_dim=16), progress=False)
    assert not (tmp_path / "out").exists()


def test_gguf_sources_default_to_a_bfloat16_output(sources):
    """A GGUF's dequantised copy is float32, but its weights never had that precision: `auto` gives bf16."""
    from mha2mla.convert.plan.resolve import make_plan
    from mha2mla.families import family_for_config

    config = json.loads((sources["llama_gqa"] / "config.json").read_text())
    family = family_for_config(config)
    assert make_plan(config, family, ConvertConfig(calib=None), source_format="gguf").dtype == "bfloat16"
    assert make_plan(config, family, ConvertConfig(calib=None, dtype="float32"), source_format="gguf").dtype == "float32"
    assert make_plan(config, family, ConvertConfig(calib=None)).dtype == "float32"
