"""Shared builders and checks of the kernel tests (tests/kernels/): inputs, the reference comparison, tiny models."""

from __future__ import annotations

import torch

from mha2mla.kernels import ATTENTION_NAME, flash_mla_attention, flash_mla_reference
from mha2mla.kernels.reference import segment_ids_from_cu_seqlens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_ATOL = 1e-5
TOLERANCE = {  # (atol, rtol) for 16-bit inputs against the fp32 reference on the same inputs
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 5e-2),
}


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def attention_inputs(batch, heads, q_len, k_len, d_nope, d_rope, d_v, dtype=torch.float32, seed=0):
    """q (B, H, Tq, d_n + d_r), k_nope (B, H, Tk, d_n), k_pe (B, Tk, d_r), v (B, H, Tk, d_v), leaves."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype).requires_grad_(True)

    return (leaf(batch, heads, q_len, d_nope + d_rope), leaf(batch, heads, k_len, d_nope), leaf(batch, k_len, d_rope),
            leaf(batch, heads, k_len, d_v))


def forward_and_grads(fn, inputs, grad_out=None, **kwargs):
    out = fn(*inputs, **kwargs)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    return out, grads, grad_out


def assert_matches_reference(inputs, atol=FP32_ATOL, rtol=0.0, **kwargs):
    """Kernel vs reference: output and the gradients of q, k_nope, k_pe (summed over heads), v."""
    out, grads, grad_out = forward_and_grads(flash_mla_attention, inputs, backend="triton", **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "cu_seqlens"}
    if "cu_seqlens" in kwargs:
        ref_kwargs["segment_ids"] = segment_ids_from_cu_seqlens(kwargs["cu_seqlens"], inputs[1].shape[2])
    ref, ref_grads, _ = forward_and_grads(flash_mla_reference, inputs, grad_out, **ref_kwargs)
    names = ["out", "dq", "dk_nope", "dk_pe", "dv"]
    errors = {}
    for name, got, want in zip(names, (out, *grads), (ref, *ref_grads)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
        errors[name] = max_abs_err(got, want)
    return errors


def decode_inputs(batch, heads, max_len, d_nope, d_rope, d_v, rank, dtype=torch.float32, seed=0, spare_rows=5):
    """q_nope (B, H, d_n), q_pe (B, H, d_r), latent_cache (B, T, r + d_r) a strided slice of a longer
    buffer (as a preallocated cache is), w_uk (H, d_n, r), w_uv (H, d_v, r)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)

    buffer = rand(batch, max_len + spare_rows, rank + d_rope)  # (B, T + spare, r + d_r)
    latent_cache = buffer[:, :max_len]  # (B, T, r + d_r) non-contiguous view
    return (rand(batch, heads, d_nope), rand(batch, heads, d_rope), latent_cache,
            rand(heads, d_nope, rank, scale=rank**-0.5), rand(heads, d_v, rank, scale=rank**-0.5))


def tiny_models(**config_kwargs):
    """The same random tiny DeepseekV3 twice: eager attention and mha2mla_triton."""
    from transformers import AutoModelForCausalLM

    from tests.common import tiny_deepseek_config

    config = tiny_deepseek_config(**config_kwargs)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so attention is far from uniform
        for name, param in eager.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    ours = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME, dtype=torch.float32)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == ATTENTION_NAME
    return eager.to(DEVICE), ours.to(DEVICE)
