"""The data of one attention layer on its way from MHA/GQA to MLA (docs/design.md §3).

Shapes (source): q_proj [H*d, D], k_proj/v_proj [G*d, D], o_proj [D, H*d]; query head h belongs to
KV group h // (H/G). Every step (``registry.py``) reads and fills one :class:`LayerWork`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
class LayerStatistics:
    """Activation statistics of one layer's attention input x (the input RMSNorm's output).

    ``None`` fields mean weight-only (x modelled as isotropic)."""

    input_covariance: torch.Tensor | None = None  # (D, D): E[x xᵀ]
    input_mean: torch.Tensor | None = None  # (D,): E[x]
    num_tokens: int = 0
    input_sample: torch.Tensor | None = None  # (n, D): some tokens' x, for per-token statistics
    # per-head moments, in the coordinates of ``moment_basis`` (m, D) when it is set (m = the rank of the
    # K/V rows, which is all the latent needs: 2048 of 8192 dims at 70B widths), else (H, D, D)
    value_covariances: torch.Tensor | None = None  # (H, m, m): E[x̄ x̄ᵀ], x̄ = a head's attention-weighted x
    key_covariances: torch.Tensor | None = None  # (H, m, m): key-side input moments per head
    moment_basis: torch.Tensor | None = None  # (m, D): orthonormal rows spanning the source K/V rows
    distance_histogram: torch.Tensor | None = None  # (H, L): source attention mass at each query-key distance
    pair_frequencies: torch.Tensor | None = None  # (d/2,): the source's rotation frequency of each pair


@dataclass
class LayerWork:
    """One layer on its way through the steps: what each step reads, and the slot it fills for the next.

    ``plan`` is the frozen ConversionPlan (convert/plan/resolve.py); ``activations`` is the calibration stream's
    view of this layer (convert/calibration/stream.LayerActivations), which only the refit and the
    reconstruction read; None without a stream."""

    layer: int
    plan: Any
    source: SourceAttention
    stats: LayerStatistics
    activations: Any = None
    rope: RopeSplit | None = None  # rope_mixing
    query: QueryNope | None = None  # rope_compensation
    latent: Latent | None = None  # lowrank
    written: LatentTensors | None = None  # kv_norm
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the layer's tensors (float64 until written)
    report: dict = field(default_factory=dict)
