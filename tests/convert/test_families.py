"""Source families beyond Llama/Mistral/Qwen2: Phi-3 (fused tensors, partial rotary, longrope), Granite
(multipliers), SmolLM3 (layers without rope), Qwen3 (q/k norm, approximated) — and the families the
format cannot hold, refused with one sentence (docs/convert.md, "Families")."""

from __future__ import annotations

import json

import pytest
import torch
from common import build_source, logits, run_cli

from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.output.portable import check_portable_folder
from mha2mla.convert.pipeline import convert

D, HEADS, HEAD_DIM = 64, 4, 16
SMALL_CALIBRATION = {"calib_samples": 4, "calib_seq_len": 32}
PHI3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}  # 12 of 16 dims rotate
PHI3_LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
    "short_factor": [1.0, 1.0, 1.1, 1.3, 1.6, 2.0], "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
}
GRANITE = {"embedding_multiplier": 6.0, "attention_multiplier": 0.2, "residual_multiplier": 0.4, "logits_scaling": 3.0}
FAMILIES = {  # name -> (model_type, config extras); rotating dims per head
    "phi3": ("phi3", {"rope_parameters": PHI3_ROPE, "partial_rotary_factor": 0.75}, 12),
    "phi3_longrope": ("phi3", {"rope_parameters": PHI3_LONGROPE, "partial_rotary_factor": 0.75,
                               "original_max_position_embeddings": 128}, 12),
    "granite": ("granite", {**GRANITE, "tie_word_embeddings": True}, 16),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0]}, 16),  # layer 1 applies no rope
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built = {}
    for name, (model_type, extra, _) in FAMILIES.items():
        for kv_heads in (1, 2):
            built[name, kv_heads] = build_source(root / f"{name}_{kv_heads}", model_type, num_kv_heads=kv_heads, pad_token_id=0,
                                                 **extra)
    built["qwen3", 1] = build_source(root / "qwen3_1", "qwen3", num_kv_heads=1)
    return built


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))


def full_capacity(name: str, kv_heads: int, **extra) -> ConvertConfig:
    rank = min(D, 2 * kv_heads * HEAD_DIM) + 1  # + the exact profile's constant channel
    if extra.get("calib", "default") is not None:  # calibrated: its forwards in float32, the exact setting
        extra.setdefault("compute_dtype", "float32")
    return ConvertConfig(profile="exact", kv_lora_rank=rank, rope_dim=FAMILIES[name][2], **extra)


@pytest.mark.parametrize("calibrated", [False, True], ids=["weight-only", "calibrated"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_mqa_full_capacity_reproduces_the_source_logits(sources, input_ids, tmp_path, name, calibrated):
    calibration = SMALL_CALIBRATION if calibrated else {"calib": None}
    convert(sources[name, 1], tmp_path / "out", full_capacity(name, 1, **calibration), progress=False)
    difference = (logits(tmp_path / "out", input_ids) - logits(sources[name, 1], input_ids)).abs().max().item()
    assert difference < 1e-4, difference


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gqa_full_capacity_differs_only_by_dropped_rotations(sources, tmp_path, name):
    """At a single position every rotation is the identity: a full-capacity GQA conversion reproduces the
    source there (whole sequences differ only by the rotations of non-principal key components)."""
    convert(sources[name, 2], tmp_path / "out", full_capacity(name, 2, calib=None), progress=False)
    one_token = torch.arange(0, 384, 48).view(-1, 1)
    difference = (logits(tmp_path / "out", one_token) - logits(sources[name, 2], one_token)).abs().max().item()
    assert difference < 1e-4, difference


def test_phi3_fused_tensors_are_split_and_longrope_kept_on_the_kept_pairs(sources, tmp_path):
    out = tmp_path / "out"
    result = convert(sources["phi3_longrope", 1], out, full_capacity("phi3_longrope", 1, calib=None), progress=False)
    config = json.loads((out / "config.json").read_text())
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["short_factor"] == PHI3_LONGROPE["short_factor"]
    assert "partial_rotary_factor" not in rope and config["qk_rope_head_dim"] == 12
    assert result.plan.shape.rotation_gain > 1  # max 512 / original 128: longrope's attention factor applies


def test_granite_multipliers_are_folded_and_embeddings_untied(sources, tmp_path):
    out = tmp_path / "out"
    result = convert(sources["granite", 1], out, full_capacity("granite", 1, calib=None), progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and result.plan.untie_embeddings
    assert not any(key in config for key in GRANITE)  # nothing left for a DeepSeek loader to ignore


def test_qwen3_is_approximate_even_at_full_capacity_and_says_so(sources, input_ids, tmp_path):
    """The per-head q/k RMSNorm has no place in the DeepSeek format; its linear stand-in is fitted on the
    calibration activations. Measured on this tiny random model (4 × 32 calibration tokens): max abs logit
    error 3.20, RMS 0.42 against a logit standard deviation of 1.19, top-1 agreement 56%; weight-only 3.14.
    The per-token scale the norm divides by is what no linear map carries. The bound keeps a margin."""
    source = sources["qwen3", 1]
    result = convert(source, tmp_path / "out", full_capacity("granite", 1, **SMALL_CALIBRATION), progress=False)
    assert any("approximate even at full capacity" in warning for warning in result.plan.warnings)
    reference = logits(source, input_ids)
    difference = (logits(tmp_path / "out", input_ids) - reference).abs().max().item()
    assert 1e-3 < difference < QWEN3_FULL_CAPACITY_BOUND, difference


QWEN3_FULL_CAPACITY_BOUND = 4.0


@pytest.mark.parametrize("name", list(FAMILIES) + ["qwen3"])
def test_portable_outputs_load_and_pass_the_checker(sources, tmp_path, name):
    out = tmp_path / "out"
    convert(sources[name, 1], out, ConvertConfig(kv_budget=0.5, **SMALL_CALIBRATION), progress=False)
    assert check_portable_folder(out) == []
    assert torch.isfinite(logits(out, torch.arange(16).view(1, -1))).all()


REFUSED = {
    "gemma2": ("gemma2", "norms after attention"),
    "olmo2": ("olmo2", "norms after attention"),
    "mixtral": ("mixtral", "mixture-of-experts"),
    "qwen3_moe": ("qwen3_moe", "mixture-of-experts"),
}


@pytest.mark.parametrize("name", list(REFUSED) + ["remote_code"])
def test_refused_families_get_one_sentence_and_nothing_written(tmp_path, capsys, name):
    if name == "remote_code":
        source = build_source(tmp_path / "src", "llama")
        config = json.loads((source / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
        (source / "config.json").write_text(json.dumps(config))
        needle = "trust_remote_code"
    else:
        model_type, needle = REFUSED[name]
        extra = {"num_local_experts": 2, "num_experts": 2, "num_experts_per_tok": 1} if "moe" in name or name == "mixtral" else {}
        source = build_source(tmp_path / "src", model_type, pad_token_id=0, **extra)
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    code, _, err = run_cli(["convert", source, out, "--no-progress"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert not out.exists() and list(out.parent.iterdir()) == []


@pytest.mark.parametrize("name", ["phi3", "phi3_longrope", "qwen3"])
def test_inspect_says_what_is_exact_and_what_is_approximated(sources, capsys, name):
    code, stdout, _ = run_cli(["inspect", sources[name, 1], "--json"], capsys)
    info = json.loads(stdout)
    assert code == 0 and info["family"] == name.removesuffix("_longrope")
    if name == "qwen3":
        assert info["exact_at_full_capacity"].startswith("nothing") and "q_norm" in info["approximated"]
    else:  # longrope is approximated only where the source uses it
        assert "partial_rotary_factor" in info["exact_at_full_capacity"]
        assert ("longrope" in info["approximated"]) == (name == "phi3_longrope")
