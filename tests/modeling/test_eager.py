"""``mha2mla_eager`` (mha2mla/modeling/eager.py): transformers' eager attention with the softmax in the scores' dtype.
In float32 it is transformers' eager exactly; in bf16 its probabilities are eager's (the float32 softmax rounded
once), and its gradients differ only by the backward reading those rounded probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mha2mla.modeling import eager
from mha2mla.modeling.eager import EAGER, eager_attention


def _run(model, ids, dtype):
    """Logits, every layer's attention probabilities and the gradients of a loss on them, with ``dtype`` weights."""
    model.zero_grad()
    out = model(input_ids=ids, output_attentions=True)
    (out.logits.float().pow(2).mean()).backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), [a.detach() for a in out.attentions], grads


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_probabilities_match_transformers_eager(tiny_mla, llama_source, kind, dtype, monkeypatch):
    calls = []
    ours = eager.eager_probabilities_attention
    monkeypatch.setattr(eager, "eager_probabilities_attention", lambda *args, **kwargs: calls.append(1) or ours(*args, **kwargs))
    folder = tiny_mla if kind == "mla" else llama_source
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(3))
    logits, probabilities, grads = _run(model, ids, dtype)
    with eager_attention(model.config):
        assert model.config._attn_implementation == EAGER
        ours_logits, ours_probabilities, ours_grads = _run(model, ids, dtype)
    assert model.config._attn_implementation == "eager"  # restored
    assert len(calls) == model.config.num_hidden_layers  # every layer's attention ran through mha2mla_eager
    assert len(probabilities) == model.config.num_hidden_layers
    for ours, theirs in zip(ours_probabilities, probabilities):
        assert ours.dtype == dtype and torch.equal(ours, theirs)
    assert torch.equal(ours_logits, logits)
    assert grads.keys() == ours_grads.keys() and len(grads) > 5
    for name, grad in grads.items():
        if dtype == torch.float32:
            assert torch.equal(ours_grads[name], grad), name
        else:
            relative = ((ours_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30)).item()
            assert relative < 3e-2, (name, relative)
