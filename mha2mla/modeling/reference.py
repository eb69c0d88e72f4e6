"""A plain-PyTorch MLA attention written the way serving engines compute it, independent of
transformers' DeepseekV3 attention code: GPT-J (interleaved) rope on q_pe / k_pe, and optionally the
absorbed form that reads only the latent cache. It is the package's own forward for the exactness
ladder (docs/convert.md, rung d) and for checking the absorbed weights (docs/generate.md).

Only plain rope (``rope_type: default``) is supported here; the serving engines' yarn is not.
"""

from __future__ import annotations

import contextlib

import torch


def rope_inverse_frequencies(config) -> torch.Tensor:
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError("the reference forward implements plain rope only")
    d_r = config.qk_rope_head_dim
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, d_r, 2, dtype=torch.float64) / d_r))  # (d_r/2,)


def gptj_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of the last dim by position * inv_freq[j] (GPT-J / vLLM
    ``is_neox_style=False``). x: (..., T, d_r); positions: (T,) or broadcastable to x[..., 0]."""
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., T, d_r/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]  # (..., T, d_r/2) each
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # (..., T, d_r/2, 2)
    return rotated.flatten(-2)  # (..., T, d_r) back in interleaved order


def mla_attention(attn, hidden_states: torch.Tensor, positions: torch.Tensor, absorbed: bool = False,
                  w_uk: torch.Tensor | None = None, w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA self-attention of one transformers ``DeepseekV3Attention`` module's weights.

    hidden_states: (B, T, D); positions: (T,). With ``absorbed=True`` keys and values are never
    expanded per head: scores use q_lat = W_UKᵀ q_nope against the latent c, and the output is
    W_UV (Σ p c). ``w_uk`` [H, d_n, r] / ``w_uv`` [H, d_v, r] default to the split of kv_b_proj.
    """
    config = attn.config
    B, T, _ = hidden_states.shape
    H, d_n, d_r, d_v, r = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank

    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(B, T, H, d_n + d_r).transpose(1, 2)  # (B, H, T, d_n+d_r)
    q_nope, q_pe = q[..., :d_n], q[..., d_n:]

    compressed = attn.kv_a_proj_with_mqa(hidden_states)  # (B, T, r+d_r)
    latent = attn.kv_a_layernorm(compressed[..., :r])  # (B, T, r): what the cache stores
    k_pe = compressed[..., r:]  # (B, T, d_r): one rope key shared by all heads

    inv_freq = rope_inverse_frequencies(config)
    q_pe = gptj_rope(q_pe, positions, inv_freq)  # (B, H, T, d_r)
    k_pe = gptj_rope(k_pe, positions, inv_freq)  # (B, T, d_r)

    if w_uk is None or w_uv is None:
        per_head = attn.kv_b_proj.weight.view(H, d_n + d_v, r)  # (H, d_n+d_v, r)
        w_uk, w_uv = per_head[:, :d_n], per_head[:, d_n:]
    causal = torch.ones(T, T, dtype=torch.bool, device=hidden_states.device).tril()

    if absorbed:
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # (B, H, T, r)
        scores = torch.einsum("bhtr,bsr->bhts", q_latent, latent) + torch.einsum("bhtp,bsp->bhts", q_pe, k_pe)
    else:
        k_nope = torch.einsum("hnr,bsr->bhsn", w_uk, latent)  # (B, H, T, d_n)
        scores = torch.einsum("bhtn,bhsn->bhts", q_nope, k_nope) + torch.einsum("bhtp,bsp->bhts", q_pe, k_pe)
    scores = (scores * attn.scaling).masked_fill(~causal, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, H, T, T)

    if absorbed:
        out_latent = torch.einsum("bhts,bsr->bhtr", probs, latent)  # (B, H, T, r)
        out = torch.einsum("hvr,bhtr->bhtv", w_uv, out_latent)  # (B, H, T, d_v)
    else:
        values = torch.einsum("hvr,bsr->bhsv", w_uv, latent)  # (B, H, T, d_v)
        out = torch.einsum("bhts,bhsv->bhtv", probs, values)
    out = out.transpose(1, 2).reshape(B, T, H * d_v)  # (B, T, H*d_v)
    return attn.o_proj(out)


@contextlib.contextmanager
def reference_attention(model, absorbed: bool = False, absorbed_tensors: dict | None = None):
    """Within the block, every attention layer of a transformers DeepseekV3 ``model`` runs
    :func:`mla_attention` instead of its own code (no cache; full sequences from position 0)."""
    originals = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        w_uk = w_uv = None
        if absorbed_tensors is not None:
            w_uk = absorbed_tensors[f"layers.{index}.w_uk"].to(attn.kv_b_proj.weight.dtype)
            w_uv = absorbed_tensors[f"layers.{index}.w_uv"].to(attn.kv_b_proj.weight.dtype)

        def forward(hidden_states, *args, _attn=attn, _w_uk=w_uk, _w_uv=w_uv, **kwargs):
            positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)
            return mla_attention(_attn, hidden_states, positions, absorbed, _w_uk, _w_uv), None

        originals.append((attn, attn.forward))
        attn.forward = forward
    try:
        yield model
    finally:
        for attn, original in originals:
            attn.forward = original
