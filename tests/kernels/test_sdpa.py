"""``mha2mla_sdpa``: the same attention as transformers' ``sdpa``/``eager`` for MLA's unequal head dims, through
PyTorch's fused kernel instead of the math path (mha2mla/kernels/sdpa.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mha2mla.evaluation.loading import load_model
from mha2mla.kernels.sdpa import PADDED_SDPA, mla_attention_for
from mha2mla.train.model import load_student


def _loss_and_grads(model, ids, attention_mask=None, position_ids=None):
    model.zero_grad()
    labels = ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -100)  # no loss on padding
    out = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("reference_attention, rows", [("eager", "full"), ("sdpa", "full"), ("eager", "packed"),
                                                       ("sdpa", "packed"), ("sdpa", "left-padded")])
def test_padded_sdpa_matches_the_unpadded_attention(tiny_mla, reference_attention, rows):
    """Same logits and gradients as eager attention and as plain ``sdpa`` (its math path) on full rows and on packed
    rows (positions restarting), and as plain ``sdpa`` on rows with left padding (eager treats fully masked padding
    rows differently, in the gradients)."""
    student = load_student(tiny_mla)
    reference = load_student(tiny_mla)
    reference.set_attn_implementation(reference_attention)
    assert student.config._attn_implementation == PADDED_SDPA
    torch.manual_seed(1)
    ids = torch.randint(0, 384, (2, 40))
    mask, positions = None, None
    if rows == "left-padded":
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
    if rows == "packed":
        positions = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, 40)
    logits, grads = _loss_and_grads(student, ids, mask, positions)
    ref_logits, ref_grads = _loss_and_grads(reference, ids, mask, positions)
    keep = slice(None) if mask is None else mask.bool()
    assert torch.allclose(logits[keep], ref_logits[keep], atol=2e-5, rtol=1e-4)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], atol=2e-5, rtol=1e-3), name


def test_padded_sdpa_runs_the_fused_kernel_where_sdpa_runs_the_math_path(tiny_mla):
    """The reason it exists: with the value padded, the CPU flash kernel runs and the math path does not (on packed
    rows, as recovery trains: the block-diagonal mask goes to the fused kernel too)."""
    student = load_student(tiny_mla)
    plain = load_student(tiny_mla)
    plain.set_attn_implementation("sdpa")
    ids = torch.randint(0, 384, (2, 64))
    positions = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64)  # two packed documents a row

    def ops(model):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
        return {event.key for event in prof.key_averages()}

    padded_ops, plain_ops = ops(student), ops(plain)
    assert "aten::_scaled_dot_product_attention_math" in plain_ops
    assert "aten::_scaled_dot_product_attention_math" not in padded_ops
    assert any("flash_attention" in op for op in padded_ops)


def test_only_mla_configs_with_a_narrower_value_head_change_implementation():
    mla = {"model_type": "deepseek_v3", "qk_nope_head_dim": 64, "qk_rope_head_dim": 16, "v_head_dim": 64}
    assert mla_attention_for(mla) == PADDED_SDPA
    assert mla_attention_for(mla, "sdpa") == PADDED_SDPA
    assert mla_attention_for(mla, "eager") == "eager"
    assert mla_attention_for({**mla, "v_head_dim": 80}, "sdpa") == "sdpa"
    assert mla_attention_for({"model_type": "llama"}) is None


def test_eval_loads_mla_with_padded_sdpa_and_saved_configs_do_not_name_it(tiny_mla, tmp_path):
    loaded = load_model(tiny_mla, dtype="float32")
    assert loaded.model.config._attn_implementation == PADDED_SDPA
    loaded.model.save_pretrained(tmp_path)
    assert PADDED_SDPA not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
