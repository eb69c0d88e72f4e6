"""One attention layer, MHA/GQA -> MLA (docs/design.md §3): the plan's step functions
(``methods.py``) put together and written as the DeepSeek-V3 tensors of one layer.

Shapes (source): q_proj [H*d, D], k_proj/v_proj [G*d, D], o_proj [D, H*d].
Shapes (target): q_proj [H*(d_n+d_r), D] with d_n = d; kv_a_proj_with_mqa [r + d_r, D];
kv_a_layernorm [r]; kv_b_proj [H*(d_n+d_v), r] with d_v = d; o_proj [D, H*d_v].
Query head h belongs to KV group h // (H/G).
"""

from __future__ import annotations

import torch

from mha2mla.convert.layer import ConvertedAttention, QueryNope, RopeSplit, SourceAttention
from mha2mla.convert.methods import step
from mha2mla.convert.norm import neutralised_norm
from mha2mla.convert.plan import ConversionPlan
from mha2mla.convert.rope import interleaved_order, pair_rows
from mha2mla.convert.stats import LayerStatistics

F64 = torch.float64


def split_rope(source: SourceAttention, plan: ConversionPlan, stats: LayerStatistics) -> RopeSplit:
    """Step 1: per kept pair, the shared rope key = a mix of the KV heads' key components; the rest
    of every head's key loses its rotation (docs/design.md §3.1)."""
    H, G, d, R = plan.shape.num_heads, plan.shape.num_kv_heads, plan.shape.head_dim, plan.shape.rotating_dims
    pairs = list(plan.rope_pairs) if source.uses_rope else []  # a layer without rope: its rope key carries nothing
    k_w = source.k_weight.to(F64).view(G, d, -1)  # (G, d, D)
    k_b = None if source.k_bias is None else source.k_bias.to(F64).view(G, d)
    mix = step("rope_mixing", plan.methods.rope_mixing).function
    key_coeff, query_coeff = mix(source.k_weight.to(F64), None if k_b is None else k_b.reshape(-1), pairs, d, R, stats)
    rope_w = torch.zeros(plan.rope_dim, k_w.shape[2], dtype=F64)  # (d_r, D): interleaved rows
    rope_b = torch.zeros(plan.rope_dim, dtype=F64)
    nope_w, nope_b = k_w.clone(), None if k_b is None else k_b.clone()
    per_head = torch.zeros(len(plan.rope_pairs), H, dtype=F64)  # (P, H); zero where the layer has no rope
    for j, pair in enumerate(pairs):
        b, a = key_coeff[j], query_coeff[j]  # (G,) rope key = Σ_g b_g k_g; group g reads a_g of it
        for c, row in enumerate(pair_rows(R, pair)):
            rope_w[2 * j + c] = torch.einsum("g,gD->D", b, k_w[:, row, :])
            nope_w[:, row, :] -= a[:, None] * rope_w[2 * j + c]
            if k_b is not None:
                rope_b[2 * j + c] = (b * k_b[:, row]).sum()
                nope_b[:, row] -= a * rope_b[2 * j + c]
        per_head[j] = a.repeat_interleave(H // G)
    return RopeSplit(key_weight=rope_w, key_bias=rope_b, key_nope_weight=nope_w, key_nope_bias=nope_b, query_coeff=per_head)


def query_tensors(source: SourceAttention, query: QueryNope, rope: RopeSplit, plan: ConversionPlan) -> dict[str, torch.Tensor]:
    """Query rows per head [q_nope (d); q_rope (d_r, interleaved)], with the softmax scale
    (d_n + d_r)^-0.5 folded in; through the q_lora pair when a q bias must be carried exactly."""
    H, d, D = plan.shape.num_heads, plan.shape.head_dim, source.q_weight.shape[1]
    d_r = plan.rope_dim
    q_scale = plan.shape.softmax_scale * (d + d_r) ** 0.5  # the target scales scores by (d + d_r)^-0.5
    q_w = source.q_weight.to(F64).view(H, d, D)
    rows = interleaved_order(list(plan.rope_pairs), plan.shape.rotating_dims)  # (d_r,) source rows in target order
    coeff = rope.query_coeff.repeat_interleave(2, dim=0).T  # (H, d_r)
    # rope scaling that scales rotated q·k terms (longrope's attention factor): the target's own scaling
    # applies it to the rope rows where the config keeps it; the rotated rows moved to NoPE need it folded
    gain = torch.ones(d + d_r, dtype=F64)
    gain[: plan.shape.rotating_dims] = plan.shape.rotation_gain
    gain[d:] = 1.0 if plan.keeps_rope_scaling else plan.shape.rotation_gain
    weight = torch.cat([query.weight, q_w[:, rows, :] * coeff[:, :, None]], dim=1) * (q_scale * gain)[:, None]  # (H, d+d_r, D)
    bias = None
    if source.q_bias is not None:
        q_b = source.q_bias.to(F64).view(H, d)
        bias = torch.cat([query.bias, q_b[:, rows] * coeff], dim=1) * (q_scale * gain)  # (H, d+d_r)
    if not plan.use_q_lora:
        if bias is not None and plan.profile == "exact":
            raise ValueError("a q bias in the exact profile needs use_q_lora=True")
        return {"q_proj.weight": weight.reshape(H * (d + d_r), D)}
    # q = q_b(norm(q_a x + b)): q_a = [I; 0] with bias [0; B], the neutralised norm, q_b = [W_q, b_q]
    norm = neutralised_norm(D + 1, plan.torch_dtype)
    bias_column = (bias if bias is not None else torch.zeros(H, d + d_r, dtype=F64)).reshape(-1, 1)
    return {
        "q_a_proj.weight": torch.cat([torch.eye(D, dtype=F64), torch.zeros(1, D, dtype=F64)]),
        "q_a_proj.bias": torch.cat([torch.zeros(D, dtype=F64), norm.bias_value.to(F64).view(1)]),
        "q_a_layernorm.weight": norm.norm_weight,
        "q_b_proj.weight": torch.cat([weight.reshape(H * (d + d_r), D) / norm.real_scale,
                                      bias_column / norm.constant_value], dim=1),
    }


def relative_error(up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor, cov: torch.Tensor | None) -> float:
    """sqrt(Σ_h E‖(U_h W − T_g(h)) x‖² / Σ_h E‖T_g(h) x‖²) for per-head ``up`` (H, d, r), ``rows`` (G, d, D)."""
    target = rows.repeat_interleave(up.shape[0] // rows.shape[0], dim=0)  # (H, d, D)
    error = up @ down - target
    if cov is None:
        num, den = float((error * error).sum()), float((target * target).sum())
    else:
        num = float(torch.einsum("hdi,ij,hdj->", error, cov, error))
        den = float(torch.einsum("hdi,ij,hdj->", target, cov, target))
    return (num / den) ** 0.5 if den > 0 else 0.0


def _energy(rows: torch.Tensor, cov: torch.Tensor | None) -> float:
    rows = rows.reshape(-1, rows.shape[-1])
    return float((rows * rows).sum()) if cov is None else float(torch.einsum("ri,ij,rj->", rows, cov, rows))


def convert_attention(source: SourceAttention, plan: ConversionPlan, stats: LayerStatistics | None = None) -> ConvertedAttention:
    """The DeepSeek-V3 tensors of one layer (names relative to ``self_attn.``) and a report."""
    stats = stats or LayerStatistics()
    methods = plan.methods
    H, G, d = plan.shape.num_heads, plan.shape.num_kv_heads, plan.shape.head_dim
    cov = None if stats.input_covariance is None else stats.input_covariance.to(F64)
    q_b = None if source.q_bias is None else source.q_bias.to(F64).view(H, d)
    value = source.v_weight.to(F64).view(G, d, -1)  # (G, d, D)

    rope = split_rope(source, plan, stats)  # 1. the shared rope key
    query = step("rope_compensation", methods.rope_compensation).function(
        source.q_weight.to(F64).view(H, d, -1), q_b, G, source.uses_rope, stats)
    latent = step("lowrank", methods.lowrank).function(rope.key_nope_weight, value, plan.latent_rank, H, query, stats)  # 2.
    written = step("kv_norm", methods.kv_norm).function(latent, rope, source, stats, plan.torch_dtype)  # 3.

    tensors = {**written.tensors, "o_proj.weight": source.o_weight.to(F64), **query_tensors(source, query, rope, plan)}
    key_energy = _energy(source.k_weight.to(F64), cov)
    report = {
        "kv_lora_rank": plan.kv_lora_rank,
        "latent_rank": plan.latent_rank,
        "rope_pairs": list(plan.rope_pairs),
        "rope_key_energy_fraction": _energy(rope.key_weight, cov) / key_energy if key_energy > 0 else 0.0,
        "k_rel_error": relative_error(latent.up_k, latent.down, rope.key_nope_weight, cov),
        "v_rel_error": relative_error(latent.up_v, latent.down, value, cov),
    }
    out = {name: tensor.to(plan.torch_dtype).contiguous() for name, tensor in tensors.items()}
    return ConvertedAttention(tensors=out, report=report, dropped_biases=written.dropped_biases)


def pad_value_heads(tensors: dict[str, torch.Tensor], num_heads: int, head_dim: int, v_head_dim: int) -> dict[str, torch.Tensor]:
    """Value heads widened from ``head_dim`` to ``v_head_dim`` with zeros, for engines whose kernels take only
    some head dims (docs/engines.md): the extra value rows of kv_b_proj produce zeros, and the o_proj
    columns that read them are zero, so the layer computes exactly what it did."""
    if v_head_dim == head_dim:
        return tensors
    H, d, pad = num_heads, head_dim, v_head_dim - head_dim
    kv_b = tensors["kv_b_proj.weight"]
    r = kv_b.shape[1]
    heads = kv_b.view(H, 2 * d, r)  # (H, [k_nope d; v d], r)
    zeros = torch.zeros(H, pad, r, dtype=kv_b.dtype)
    out = dict(tensors)
    out["kv_b_proj.weight"] = torch.cat([heads, zeros], dim=1).reshape(H * (d + v_head_dim), r).contiguous()
    o_proj = tensors["o_proj.weight"]  # (D, H*d)
    D = o_proj.shape[0]
    out["o_proj.weight"] = torch.cat([o_proj.view(D, H, d), torch.zeros(D, H, pad, dtype=o_proj.dtype)], dim=2).reshape(D, -1)
    return out
