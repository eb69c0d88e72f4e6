"""Eager attention on demand: an eager softmax returns the attention probabilities, which sdpa does not.

transformers' own eager function takes the softmax in float32 and casts the probabilities back to the compute
dtype: in bf16 that is two extra passes over the (b, H, L, L) tensor forward and two more backward, a share of
every reconstruction step on the CPU (docs/benchmarks.md, "conversion cost"). ``mha2mla_eager`` takes the softmax
in the scores' own dtype. PyTorch's reduced-precision softmax accumulates in float32, so the probabilities are
those of the float32 softmax rounded once, as before (tests/modeling/test_eager.py); only the backward reads the
rounded probabilities where transformers' read the float32 ones. In float32 it is transformers' eager.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

EAGER = "mha2mla_eager"


def eager_probabilities_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                                  **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention (grouped keys and values repeated, the additive mask, dropout) with the softmax in
    the scores' dtype; returns the output (B, T, H, d_v) and the probabilities (B, H, T, T)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probabilities = torch.nn.functional.softmax(scores, dim=-1)
    probabilities = torch.nn.functional.dropout(probabilities, p=dropout, training=module.training)
    return torch.matmul(probabilities, value).transpose(1, 2).contiguous(), probabilities


def register_eager() -> str:
    """Register ``mha2mla_eager`` with transformers (idempotent; masks as for ``eager``); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(EAGER, eager_probabilities_attention)
    AttentionMaskInterface.register(EAGER, eager_mask)
    return EAGER


@contextmanager
def eager_attention(*configs):
    """Run the attention of these configs' modules with an eager softmax (``mha2mla_eager``: it returns the
    probabilities)."""
    name = register_eager()
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = name
        yield
    finally:
        for config, implementation in zip(configs, saved):
            config._attn_implementation = implementation
