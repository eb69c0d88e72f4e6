"""One attention layer, MHA/GQA -> MLA (docs/design.md §3): the plan's steps (``registry.py``) run in
order, and their results assembled as the DeepSeek-V3 tensors of one layer.

Shapes (source): q_proj [H*d, D], k_proj/v_proj [G*d, D], o_proj [D, H*d].
Shapes (target): q_proj [H*(d_n+d_r), D] with d_n = d; kv_a_proj_with_mqa [r + d_r, D];
kv_a_layernorm [r]; kv_b_proj [H*(d_n+d_v), r] with d_v = d; o_proj [D, H*d_v].
Query head h belongs to KV group h // (H/G).
"""

from __future__ import annotations

import torch

from mha2mla.convert.phases import PHASE_OF_STEP, phase
from mha2mla.convert.steps.norm import neutralised_norm
from mha2mla.convert.steps.records import LayerWork
from mha2mla.convert.steps.registry import FIT_KINDS, LATENT_KINDS, no_fit, step
from mha2mla.convert.steps.rope import interleaved_order

F64 = torch.float64


def query_tensors(work: LayerWork) -> dict[str, torch.Tensor]:
    """Query rows per head [q_nope (d); q_rope (d_r, interleaved)], with the softmax scale
    (d_n + d_r)^-0.5 folded in; through the q_lora pair when a q bias must be carried exactly."""
    source, query, rope, plan = work.source, work.query, work.rope, work.plan
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


def run_steps(work: LayerWork, kinds: tuple[str, ...]) -> None:
    """Run the plan's step of each kind in ``kinds`` on ``work``, in order."""
    for kind in kinds:
        function = step(kind, getattr(work.plan.methods, kind)).function
        if function is not no_fit:  # a fit step the plan leaves out is not charged to a phase
            with phase(PHASE_OF_STEP.get(kind, kind)):
                function(work)


def assemble(work: LayerWork) -> None:
    """The DeepSeek-V3 tensors of the layer (names relative to ``self_attn.``) from the latent steps' results,
    held in the output dtype from here on, so that the refit and the reconstruction fit what is written; and the
    layer's report."""
    plan, source, latent, rope = work.plan, work.source, work.latent, work.rope
    G, d = plan.shape.num_kv_heads, plan.shape.head_dim
    cov = None if work.stats.input_covariance is None else work.stats.input_covariance.to(F64)
    tensors = {**work.written.tensors, "o_proj.weight": source.o_weight.to(F64), **query_tensors(work)}
    work.tensors = {name: tensor.to(plan.torch_dtype).contiguous() for name, tensor in tensors.items()}
    key_energy = _energy(source.k_weight.to(F64), cov)
    work.report.update({
        "kv_lora_rank": plan.kv_lora_rank,
        "latent_rank": plan.latent_rank,
        "rope_pairs": list(plan.rope_pairs),
        "rope_key_energy_fraction": _energy(rope.key_weight, cov) / key_energy if key_energy > 0 else 0.0,
        "k_rel_error": relative_error(latent.up_k, latent.down, rope.key_nope_weight, cov),
        "v_rel_error": relative_error(latent.up_v, latent.down, source.v_weight.to(F64).view(G, d, -1), cov),
    })


def convert_attention(work: LayerWork) -> dict[str, torch.Tensor]:
    """Every step of the plan on one layer: the latent steps, the assembly, the fit steps. Returns the layer's
    tensors, value heads padded to the plan's ``v_head_dim``; ``work.report`` holds the layer's report."""
    run_steps(work, LATENT_KINDS)
    with phase("solves"):
        assemble(work)
    run_steps(work, FIT_KINDS)
    plan = work.plan
    return pad_value_heads(work.tensors, plan.shape.num_heads, plan.shape.head_dim, plan.v_head_dim)


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
