"""A tiny DeepseekV3 through ``attn_implementation="mha2mla_triton"`` against eager attention (docs/kernels.md):
loss and every parameter gradient in float32 and under bf16 autocast, padding, packing and generation."""

from __future__ import annotations

import torch
from kernel_checks import DEVICE, FP32_ATOL, max_abs_err, tiny_models


def test_tiny_deepseek_same_loss_and_gradients_as_eager():
    eager, ours = tiny_models(qk_nope_head_dim=12, v_head_dim=10)  # odd head dims on purpose
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    eager_loss = eager(ids, labels=ids).loss
    eager_loss.backward()
    calls = []
    import mha2mla.kernels.flash_mla as flash_module

    original = flash_module._forward
    flash_module._forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        our_loss = ours(ids, labels=ids).loss
    finally:
        flash_module._forward = original
    our_loss.backward()
    assert len(calls) == 2, "both layers must run through the Triton kernel"
    assert abs(eager_loss.item() - our_loss.item()) <= FP32_ATOL
    for (name, p_eager), p_ours in zip(eager.named_parameters(), ours.parameters()):
        assert p_ours.grad is not None and p_eager.grad.abs().max() > 0, name
        assert max_abs_err(p_ours.grad, p_eager.grad) <= FP32_ATOL, name


def test_tiny_deepseek_padding_packing_and_generation():
    eager, ours = tiny_models()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 384, (2, 24), generator=gen).to(DEVICE)
    with torch.no_grad():
        # padding: row 0 right-padded by 5, row 1 left-padded by 7; compare real positions only
        mask = torch.ones(2, 24, dtype=torch.long, device=DEVICE)
        mask[0, -5:] = 0
        mask[1, :7] = 0
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        want = eager(ids, attention_mask=mask, position_ids=position_ids).logits
        got = ours(ids, attention_mask=mask, position_ids=position_ids).logits
        real = mask.bool()
        assert max_abs_err(got[real], want[real]) <= FP32_ATOL
        # packing: two sequences in one row, restarting position ids == each sequence alone
        first, second = ids[0, :10], ids[1, :14]
        packed = torch.cat([first, second])[None]  # (1, 24)
        positions = torch.cat([torch.arange(10), torch.arange(14)])[None].to(DEVICE)
        got = ours(packed, position_ids=positions).logits[0]
        assert max_abs_err(got[:10], eager(first[None]).logits[0]) <= FP32_ATOL
        assert max_abs_err(got[10:], eager(second[None]).logits[0]) <= FP32_ATOL
        # generation with a cache (queries after cached keys: the causal offset path)
        prompt = ids[:1, :9]
        want_tokens = eager.generate(prompt, max_new_tokens=4, do_sample=False)
        got_tokens = ours.generate(prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(got_tokens, want_tokens)



def test_tiny_deepseek_bf16_autocast_matches_eager():
    """bf16 recovery through the kernel: under autocast the query arrives in float32 (rotary products) and the keys
    and values in bf16; the kernel computes in bf16 with float32 accumulation. Loss and every parameter gradient
    match eager attention under the same autocast within bf16 noise (relative to each gradient's size)."""
    eager, ours = tiny_models(qk_nope_head_dim=12, v_head_dim=10)
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    losses = []
    for model in (eager, ours):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[0]), losses
    for (name, p_eager), p_ours in zip(eager.named_parameters(), ours.parameters()):
        assert p_ours.grad is not None and p_ours.grad.dtype == torch.float32, name
        scale = p_eager.grad.abs().max().item()
        assert scale > 0, name
        assert max_abs_err(p_ours.grad, p_eager.grad) <= 0.1 * scale, (name, max_abs_err(p_ours.grad, p_eager.grad), scale)
