"""One calibrated layer's memory (mha2mla/convert/calibration/memory.py): activations on disk give the same conversion,
a budget that cannot hold a layer is one sentence before any work, and the estimate's terms at real widths."""

from __future__ import annotations

import glob
import json
import tempfile

import pytest
import torch
from common import build_source, run_cli
from safetensors.torch import load_file

from mha2mla.convert.calibration import memory
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_source(tmp_path_factory.mktemp("memory") / "llama", "llama", num_heads=4, num_kv_heads=1)


def test_activations_on_disk_convert_to_the_same_weights(source, tmp_path, monkeypatch):
    options = ConvertConfig(kv_budget=0.5, calib_samples=6, calib_seq_len=32)
    convert(source, tmp_path / "memory", options, progress=False)
    made = []
    real = memory.host_buffer

    def on_disk_buffer(shape, on_disk):
        made.append(on_disk)
        return real(shape, on_disk)

    monkeypatch.setattr("mha2mla.convert.calibration.stream.check_budget", lambda plan, budget: True)
    monkeypatch.setattr("mha2mla.convert.calibration.stream.host_buffer", on_disk_buffer)
    convert(source, tmp_path / "disk", options, progress=False)
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    # both streams (converted and source), then each layer's source head outputs, all file-backed
    assert made == [True] * (2 + layers)
    assert not glob.glob(f"{tempfile.gettempdir()}/mha2mla-calibration-*")  # nothing left behind
    first, second = load_file(tmp_path / "memory" / "model.safetensors"), load_file(tmp_path / "disk" / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)


def test_a_budget_that_cannot_hold_one_layer_is_one_sentence(source, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("convert:\n  kv_budget: 0.5\n  max_memory: 0.0001\n")
    code, stdout, err = run_cli(["convert", str(source), str(tmp_path / "out"), "--recipe", str(recipe)], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "max_memory 0.0001 GiB" in lines[0] and "--calib-device cuda" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_estimate_at_70b_widths_fits_24_gib_and_shrinks_the_moments():
    """Llama-3-70B's layer (hidden 8192, 64 heads, 8 KV heads, MLP 28672) with the default calibration: the
    per-head moments are measured in the 2048-dim K/V row space; with ``--no-reconstruct`` (the refit's method
    set) the o_proj refit works on the 8192 head outputs."""
    from mha2mla.convert.plan.resolve import make_plan
    from mha2mla.families import family_for_config

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "num_hidden_layers": 80, "vocab_size": 128256,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 500000.0}
    plan = make_plan(config, family_for_config(config), ConvertConfig(kv_budget=0.3125))
    assert plan.calibration.samples == 128  # wide models keep 128 windows (256 below hidden size 4096)
    terms = memory.layer_memory(plan)
    assert terms["per-head moments"] == 2 * 64 * 2048**2 * 4 + 2 * 8192**2 * 8  # (H, m, m) float32 ×2, (D, D) float64
    assert "o_proj refit moments" not in terms and "reconstruction inputs and targets" in terms
    assert sum(terms.values()) < 24 * 1024**3
    refit_plan = make_plan(config, family_for_config(config), ConvertConfig(kv_budget=0.3125, reconstruct=False))
    refit_terms = memory.layer_memory(refit_plan)
    single_pass = 2 * (64 * plan.latent_rank) ** 2 * 8  # moments of the latents themselves: (H·r)² per fold
    assert refit_terms["o_proj refit moments"] * 5 < single_pass
    assert sum(refit_terms.values()) < 24 * 1024**3


def test_row_space_moments_keep_full_capacity_exact(source, tmp_path, monkeypatch):
    """With the per-head moments in the K/V row space (what 70B widths use), the default calibrated method at
    full capacity (exact profile) still reproduces the source's logits, and every layer used the basis."""
    from common import logits

    from mha2mla.convert import pipeline
    from mha2mla.convert.calibration import measure as calibration

    monkeypatch.setattr(calibration, "DENSE_MOMENTS_LIMIT", 0)
    seen = []

    def statistics(activations):
        stats = calibration.measure(activations)
        seen.append(None if stats.moment_basis is None else tuple(stats.moment_basis.shape))
        return stats

    monkeypatch.setattr(pipeline, "measure", statistics)
    options = ConvertConfig(profile="exact", kv_lora_rank=2 * 16 + 1, rope_dim=16, calib_samples=4, calib_seq_len=32,
                             compute_dtype="float32")
    convert(source, tmp_path / "out", options, progress=False)
    assert seen and all(shape == (32, 64) for shape in seen), seen  # MQA: 2 · 1 · 16 rows of 64 dims
    input_ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))
    difference = (logits(tmp_path / "out", input_ids) - logits(source, input_ids)).abs().max().item()
    assert difference < 1e-4, difference
