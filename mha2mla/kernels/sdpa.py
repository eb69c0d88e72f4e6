"""``attn_implementation="mha2mla_sdpa"``: transformers' SDPA attention for MLA models, on PyTorch's fused kernels.

transformers' DeepseekV3Attention hands its attention function a query and key of qk_nope + qk_rope channels per
head and a value of v_head_dim channels. Ours differ (the converted rope key adds channels to the query/key, not to
the value), and PyTorch's fused SDPA kernels need one head dim for all three, so plain ``sdpa`` falls back to the
math path: it materialises the T x T scores, runs a separate softmax and keeps both for the backward pass. Here
the value is zero-padded to the query/key head dim and the output cut back: zero value channels give zero output
channels, so the result is the same attention (docs/recover.md, "Attention kernel on the CPU"). transformers'
own SDPA function does the rest (masks, GQA, causal flag), so padding masks work as with ``sdpa``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PADDED_SDPA = "mha2mla_sdpa"


def padded_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` with ``value`` (B, H, Tk, d_v) padded to query/key's head dim;
    returns (B, Tq, H, d_v) as transformers expects."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim >= qk_dim:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, _ = sdpa_attention_forward(module, query, key, F.pad(value, (0, qk_dim - v_dim)), attention_mask, **kwargs)
    return out[..., :v_dim], None


def register_padded_sdpa() -> str:
    """Register ``mha2mla_sdpa`` with transformers (idempotent; masks as for ``sdpa``); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PADDED_SDPA, padded_sdpa_attention)
    AttentionMaskInterface.register(PADDED_SDPA, sdpa_mask)
    return PADDED_SDPA


def mla_attention_for(config: dict, requested: str | None = None) -> str | None:
    """The implementation to load a model with: ``mha2mla_sdpa`` (registered) where ``sdpa`` or transformers'
    default (None) is requested for a DeepSeek-V3 config whose value head is narrower than its query/key head,
    ``requested`` otherwise."""
    qk_dim = config.get("qk_nope_head_dim", 0) + config.get("qk_rope_head_dim", 0)
    if requested not in (None, "sdpa") or config.get("model_type") != "deepseek_v3":
        return requested
    return register_padded_sdpa() if config.get("v_head_dim", qk_dim) < qk_dim else requested
