"""The data of one attention layer on its way from MHA/GQA to MLA (docs/design.md §3).

Shapes (source): q_proj [H*d, D], k_proj/v_proj [G*d, D], o_proj [D, H*d]; query head h belongs to
KV group h // (H/G). The conversion steps (``methods.py``) pass these records along; ``attention.py``
puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SourceAttention:
    """One source layer's attention weights, as read from the checkpoint."""

    q_weight: torch.Tensor  # (H*d, D)
    k_weight: torch.Tensor  # (G*d, D)
    v_weight: torch.Tensor  # (G*d, D)
    o_weight: torch.Tensor  # (D, H*d)
    input_norm_weight: torch.Tensor  # (D,)
    q_bias: torch.Tensor | None = None  # (H*d,)
    k_bias: torch.Tensor | None = None  # (G*d,)
    v_bias: torch.Tensor | None = None  # (G*d,)
    o_bias: torch.Tensor | None = None  # (D,)
    uses_rope: bool = True  # False for a layer that applies no rope (SmolLM3): every key dim is NoPE already


@dataclass
class RopeSplit:
    """Step 1's result: the shared rope key and what is left of each KV head's key."""

    key_weight: torch.Tensor  # (d_r, D): the shared rope key's rows, interleaved order
    key_bias: torch.Tensor  # (d_r,)
    key_nope_weight: torch.Tensor  # (G, d, D): each KV head's key, rotation dropped
    key_nope_bias: torch.Tensor | None  # (G, d)
    query_coeff: torch.Tensor  # (P, H): how strongly query head h reads kept pair p of the rope key


@dataclass
class QueryNope:
    """What reads the NoPE content: the query rows, and how much of each NoPE key row survives that read."""

    weight: torch.Tensor  # (H, d, D)
    bias: torch.Tensor | None  # (H, d)
    key_row_weight: torch.Tensor | None = None  # (G, d): weights of the NoPE key rows in the latent's objective


@dataclass
class Latent:
    """Step 2's result: per-query-head up-projections of a shared latent."""

    up_k: torch.Tensor  # (H, d, r)
    up_v: torch.Tensor  # (H, d, r)
    down: torch.Tensor  # (r, D)


@dataclass
class LatentTensors:
    """Step 3's result: the latent side of the target layer, written under transformers' names."""

    tensors: dict[str, torch.Tensor]  # kv_a_proj_with_mqa.*, kv_a_layernorm.weight, kv_b_proj.weight, o_proj.bias
    dropped_biases: list[str] = field(default_factory=list)


@dataclass
class ConvertedAttention:
    tensors: dict[str, torch.Tensor]  # names relative to ``self_attn.``
    report: dict = field(default_factory=dict)
    dropped_biases: list[str] = field(default_factory=list)
