"""The student's latents brought to the scale of their layer's input before training (model.balance_latent_scales):
the same function, the latent norm's weight at the input norm's RMS, the up-projection carrying the rest."""

from __future__ import annotations

import pytest
import torch
from common import tiny_deepseek_config
from transformers import AutoModelForCausalLM

from mha2mla.train.model.student import load_student


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.detach().pow(2).mean().sqrt())


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_the_latents_are_balanced_and_the_logits_unchanged(tmp_path, q_lora_rank):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(q_lora_rank=q_lora_rank))
    with torch.no_grad():  # a converted model's shape of scales: a large latent norm, a small up-projection
        for layer in model.model.layers:
            attention = layer.self_attn
            layer.input_layernorm.weight.uniform_(0.01, 0.05)
            pairs = [(attention.kv_a_layernorm, attention.kv_b_proj)]
            pairs += [(attention.q_a_layernorm, attention.q_b_proj)] if q_lora_rank else []
            for norm, up in pairs:
                norm.weight.uniform_(0.8, 1.6)
                up.weight.mul_(0.05)
    model.save_pretrained(tmp_path / "model")
    tokens = torch.randint(0, 384, (2, 24))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)(tokens).logits
        student = load_student(tmp_path / "model")
        student.eval()
        torch.testing.assert_close(student(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    for layer, before in zip(student.model.layers, model.model.layers):
        reference = _rms(layer.input_layernorm.weight)
        attention, original = layer.self_attn, before.self_attn
        assert _rms(attention.kv_a_layernorm.weight) == pytest.approx(reference, rel=1e-5)
        scale = _rms(original.kv_a_layernorm.weight) / reference
        assert scale > 20  # the test's latents were far larger than the input
        torch.testing.assert_close(attention.kv_b_proj.weight, original.kv_b_proj.weight * scale)
        if q_lora_rank:
            assert _rms(attention.q_a_layernorm.weight) == pytest.approx(reference, rel=1e-5)


def test_a_neutralised_latent_norm_is_left_as_it_is(tmp_path):
    """The exact profile's latent norm does not normalise (a constant channel sets the RMS it divides by): its weight
    is large but its latent passes at its own scale, so recovery leaves it and its up-projection alone."""
    from common import build_source

    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    source = build_source(tmp_path / "source", "llama", num_heads=4, num_kv_heads=2)
    convert(source, tmp_path / "exact", ConvertConfig(calib=None, profile="exact", kv_budget=0.5), progress=False)
    written = AutoModelForCausalLM.from_pretrained(tmp_path / "exact", dtype=torch.float32)
    student = load_student(tmp_path / "exact")
    for layer, before in zip(student.model.layers, written.model.layers):
        assert _rms(before.self_attn.kv_a_layernorm.weight) > 100  # what a weight-based balance would have divided
        torch.testing.assert_close(layer.self_attn.kv_a_layernorm.weight, before.self_attn.kv_a_layernorm.weight,
                                   rtol=0, atol=0)
        torch.testing.assert_close(layer.self_attn.kv_b_proj.weight, before.self_attn.kv_b_proj.weight, rtol=0, atol=0)
