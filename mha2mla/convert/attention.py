"""One attention layer, MHA/GQA -> MLA (DESIGN §3): the math of rope.py, lowrank.py and norm.py
put together, written as the DeepSeek-V3 tensors of one layer.

Shapes (source): q_proj [H*d, D], k_proj/v_proj [G*d, D], o_proj [D, H*d].
Shapes (target): q_proj [H*(d_n+d_r), D] with d_n = d; kv_a_proj_with_mqa [r + d_r, D];
kv_a_layernorm [r]; kv_b_proj [H*(d_n+d_v), r] with d_v = d; o_proj [D, H*d_v].
Query head h belongs to KV group h // (H/G).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mha2mla.convert.calibration import calibrated_norm, stabilized_norm
from mha2mla.convert.lowrank import attention_aware_low_rank, joint_low_rank
from mha2mla.convert.norm import neutralised_norm
from mha2mla.convert.rope import interleaved_order, pair_rows, rope_coefficients, second_moment


@dataclass
class LayerStatistics:
    """Activation statistics of one layer's attention input (the seam for calibration-aware init).

    ``input_covariance`` is E[x xᵀ] and ``input_mean`` E[x] for x = the input RMSNorm's output.
    ``None`` means weight-only (x modelled as isotropic)."""

    input_covariance: torch.Tensor | None = None  # (D, D)
    input_mean: torch.Tensor | None = None  # (D,)
    num_tokens: int = 0
    input_sample: torch.Tensor | None = None  # (n, D) some of the tokens' x, for per-token statistics
    value_covariances: torch.Tensor | None = None  # (H, D, D): E[x̄ x̄ᵀ], x̄ = a head's attention-weighted x
    key_covariances: torch.Tensor | None = None  # (H, D, D): key-side input moments per head
    distance_histogram: torch.Tensor | None = None  # (H, L): source attention mass at each query-key distance
    pair_frequencies: torch.Tensor | None = None  # (d/2,): the source's rotation frequency of each pair


@dataclass
class SourceAttention:
    q_weight: torch.Tensor  # (H*d, D)
    k_weight: torch.Tensor  # (G*d, D)
    v_weight: torch.Tensor  # (G*d, D)
    o_weight: torch.Tensor  # (D, H*d)
    input_norm_weight: torch.Tensor  # (D,)
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass
class AttentionPlan:
    num_heads: int  # H
    num_kv_heads: int  # G
    head_dim: int  # d
    rope_pairs: list[int]  # source pairs kept as rope, in target order
    latent_rank: int  # real latent channels (without the exact profile's constant channel)
    profile: str = "portable"  # "portable" | "exact"
    dtype: torch.dtype = torch.float32
    balance: bool = True
    use_q_lora: bool = False  # exact profile with a q bias: q through q_a_proj (bias) + neutralised norm
    # methods (docs/calibration.md); with no statistics every method is weight-only
    rope_mixing: str = "activation"  # weight | activation | query  (rope.py)
    lowrank: str = "pca"  # svd | pca | whiten | score | attention  (lowrank.py)
    norm_calibration: str = "rms"  # portable kv_a_layernorm: rms | mean | channel | stabilized (calibration.py)
    stabilizer_channels: int = 0  # portable, "stabilized": latent channels that only steady the norm
    rope_compensation: str = "none"  # none | mean: what stands in for a dropped rotation (attention.py)
    refit: str = "none"  # none | values | output: read-out refitted on the converted layer (calibration.py, pipeline)

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.rope_pairs)

    @property
    def kv_lora_rank(self) -> int:
        """The config's kv_lora_rank: what the cache stores (constant channel included)."""
        return self.latent_rank + (1 if self.profile == "exact" else 0) + self.stabilizer_channels


@dataclass
class ConvertedAttention:
    tensors: dict[str, torch.Tensor]  # names relative to ``self_attn.``
    report: dict = field(default_factory=dict)
    dropped_biases: list[str] = field(default_factory=list)


def mean_rotation(histogram: torch.Tensor, frequencies) -> tuple[torch.Tensor, torch.Tensor]:
    """E[cos Δθ], E[sin Δθ] per head and pair under the distance distribution ``histogram`` (H, L)."""
    histogram = histogram.to(torch.float64)
    histogram = histogram / histogram.sum(-1, keepdim=True).clamp_min(1e-30)
    distance = torch.arange(histogram.shape[-1], dtype=torch.float64)
    angle = distance[:, None] * torch.as_tensor(frequencies, dtype=torch.float64)[None]  # (L, P)
    return histogram @ angle.cos(), histogram @ angle.sin()  # (H, P) each


def compensate_dropped_rotations(q_w, q_b, histogram, frequencies):
    """Query rows whose key lost its rotation read the key through E[R(-Δθ)] instead of the identity.

    With both sides rotated, q_m·k_n = qᵀ R(-Δθ) k for Δ = m - n. Once k loses its rotation (NoPE
    content) the best constant stand-in, over distances weighted by the source's attention, is
    A = E[R(-Δθ)] = [[C, S], [-S, C]]; the query takes Aᵀ q."""
    H, d, D = q_w.shape
    half = d // 2
    C, S = mean_rotation(histogram, frequencies)  # (H, half)
    first, second = q_w[:, :half], q_w[:, half:]
    out = torch.cat([C[..., None] * first - S[..., None] * second, S[..., None] * first + C[..., None] * second], dim=1)
    out_b = None
    if q_b is not None:
        b1, b2 = q_b[:, :half], q_b[:, half:]
        out_b = torch.cat([C * b1 - S * b2, S * b1 + C * b2], dim=1)
    return out, out_b


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


def convert_attention(source: SourceAttention, plan: AttentionPlan, stats: LayerStatistics | None = None) -> ConvertedAttention:
    stats = stats or LayerStatistics()
    f64 = torch.float64
    H, G, d = plan.num_heads, plan.num_kv_heads, plan.head_dim
    D = source.q_weight.shape[1]
    heads_per_group = H // G
    d_r = plan.rope_dim
    cov = None if stats.input_covariance is None else stats.input_covariance.to(f64)
    mean = None if stats.input_mean is None else stats.input_mean.to(f64)

    q_w = source.q_weight.to(f64).view(H, d, D)  # (H, d, D)
    k_w = source.k_weight.to(f64).view(G, d, D)  # (G, d, D)
    v_w = source.v_weight.to(f64)  # (G*d, D)
    q_b = None if source.q_bias is None else source.q_bias.to(f64).view(H, d)
    k_b = None if source.k_bias is None else source.k_bias.to(f64).view(G, d)
    v_b = None if source.v_bias is None else source.v_bias.to(f64)

    q_nope_w, q_nope_b = q_w, q_b  # what reads the NoPE content
    if plan.rope_compensation == "mean" and stats.distance_histogram is not None:
        q_nope_w, q_nope_b = compensate_dropped_rotations(q_w, q_b, stats.distance_histogram, stats.pair_frequencies)

    # softmax scale (d_n + d_r)^-0.5 instead of d^-0.5: fold the ratio into the query rows
    q_scale = ((d + d_r) / d) ** 0.5

    # query second moment per head, E[q qᵀ] (H, d, d): weighs what the keys are read with
    q_moment = torch.stack([
        second_moment(q_w[h], None if q_b is None else q_b[h], cov, mean) for h in range(H)
    ]) if (plan.rope_mixing == "query" or plan.lowrank == "score") else None

    # --- 1. RoPE split with per-frequency head mixing ------------------------------------------
    mixing_cov, mixing_mean = (None, None) if plan.rope_mixing == "weight" else (cov, mean)
    query_energy = None
    if plan.rope_mixing == "query":  # (P, G): E|q|² of each group's query heads at each kept pair
        diagonal = q_moment.diagonal(dim1=1, dim2=2).view(G, heads_per_group, d).sum(1)  # (G, d)
        query_energy = torch.stack([sum(diagonal[:, row] for row in pair_rows(d, pair)) for pair in plan.rope_pairs]) \
            if plan.rope_pairs else torch.zeros(0, G, dtype=f64)
    key_coeff, query_coeff = rope_coefficients(
        source.k_weight.to(f64), None if k_b is None else k_b.reshape(-1), plan.rope_pairs, d, mixing_cov, mixing_mean,
        query_energy,
    )
    rope_rows = interleaved_order(plan.rope_pairs, d)  # source rows, interleaved target order (d_r,)
    k_rope_w = torch.zeros(d_r, D, dtype=f64)  # the shared rope key's rows
    k_rope_b = torch.zeros(d_r, dtype=f64)
    key_nope_w = k_w.clone()  # (G, d, D): what is left of each KV head's key, rotation dropped
    key_nope_b = None if k_b is None else k_b.clone()
    q_rope_coeff = torch.zeros(len(plan.rope_pairs), H, dtype=f64)  # per kept pair, per query head
    for j, pair in enumerate(plan.rope_pairs):
        b, a = key_coeff[j], query_coeff[j]  # (G,) rope key = Σ_g b_g k_g; group g reads a_g of it
        for c, row in enumerate(pair_rows(d, pair)):
            k_rope_w[2 * j + c] = torch.einsum("g,gD->D", b, k_w[:, row, :])
            key_nope_w[:, row, :] -= a[:, None] * k_rope_w[2 * j + c]
            if k_b is not None:
                k_rope_b[2 * j + c] = (b * k_b[:, row]).sum()
                key_nope_b[:, row] -= a * k_rope_b[2 * j + c]
        q_rope_coeff[j] = a.repeat_interleave(heads_per_group)

    # query rows per head: [q_nope (d) ; q_rope (d_r, interleaved)]
    q_rope_w = q_w[:, rope_rows, :] * q_rope_coeff.repeat_interleave(2, dim=0).T[:, :, None]  # (H, d_r, D)
    q_target_w = torch.cat([q_nope_w, q_rope_w], dim=1) * q_scale  # (H, d+d_r, D)
    q_target_b = None
    if q_b is not None:
        q_rope_b = q_b[:, rope_rows] * q_rope_coeff.repeat_interleave(2, dim=0).T  # (H, d_r)
        q_target_b = torch.cat([q_nope_b, q_rope_b], dim=1) * q_scale  # (H, d+d_r)

    # --- 2. joint low rank of [K_nope; V] -------------------------------------------------------
    key_metric = value_metric = None
    if plan.lowrank == "score":
        nope_moment = torch.stack([
            second_moment(q_nope_w[h], None if q_nope_b is None else q_nope_b[h], cov, mean) for h in range(H)])
        key_metric = nope_moment.view(G, heads_per_group, d, d).sum(1)  # (G, d, d): Σ_h E[q_h q_hᵀ]
        o_heads = source.o_weight.to(f64).view(D, G, heads_per_group, d)  # (D, G, H/G, d)
        value_metric = torch.einsum("Dghi,Dghj->gij", o_heads, o_heads)  # (G, d, d): Σ_h W_o,hᵀ W_o,h
    if plan.lowrank == "attention" and stats.value_covariances is not None:
        key_row_weight = None
        if plan.rope_compensation == "mean" and stats.distance_histogram is not None:
            # what survives of each NoPE key row once its reader takes Aᵀq: |A|² = C² + S² per pair (the
            # latent need not spend rank on rows whose rotation averaged away)
            C, S = mean_rotation(stats.distance_histogram, stats.pair_frequencies)  # (H, d/2)
            surviving = (C * C + S * S).view(G, heads_per_group, -1).mean(1)  # (G, d/2)
            key_row_weight = torch.cat([surviving, surviving], dim=1).sqrt()  # (G, d): rows i, i + d/2 of pair i
        up_k, up_v, down = attention_aware_low_rank(
            key_nope_w, v_w.view(G, d, D), plan.latent_rank, cov, stats.value_covariances, stats.key_covariances,
            key_row_weight=key_row_weight)
    else:  # one up-projection per KV group, shared by its query heads
        factors = joint_low_rank(key_nope_w.reshape(G * d, D), v_w, plan.latent_rank, cov, balance=plan.balance,
                                 method="pca" if plan.lowrank == "attention" else plan.lowrank,
                                 key_metric=key_metric, value_metric=value_metric)
        up_k = factors.up[: G * d].view(G, d, -1).repeat_interleave(heads_per_group, dim=0)  # (H, d, r)
        up_v = factors.up[G * d :].view(G, d, -1).repeat_interleave(heads_per_group, dim=0)  # (H, d, r)
        down = factors.down  # (r, D)
    key_error = relative_error(up_k, down, key_nope_w, cov)
    value_error = relative_error(up_v, down, v_w.view(G, d, D), cov)

    tensors: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    exact = plan.profile == "exact"
    r = plan.latent_rank

    if exact:
        # --- 3. neutralise kv_a_layernorm with a constant channel (the last latent channel) ----
        norm = neutralised_norm(r + 1, plan.dtype)
        kv_a_w = torch.cat([down, torch.zeros(1, D, dtype=f64), k_rope_w], dim=0)  # (r+1+d_r, D)
        kv_a_b = torch.cat([torch.zeros(r, dtype=f64), norm.bias_value.to(f64).view(1), k_rope_b])
        const_k = key_nope_b if key_nope_b is not None else torch.zeros(G, d, dtype=f64)
        const_v = v_b.view(G, d) if v_b is not None else torch.zeros(G, d, dtype=f64)
        const_k, const_v = const_k.repeat_interleave(heads_per_group, 0), const_v.repeat_interleave(heads_per_group, 0)
        up_k = torch.cat([up_k / norm.real_scale, const_k[:, :, None] / norm.constant_value], dim=2)  # (H, d, r+1)
        up_v = torch.cat([up_v / norm.real_scale, const_v[:, :, None] / norm.constant_value], dim=2)
        tensors["kv_a_proj_with_mqa.bias"] = kv_a_b
        tensors["kv_a_layernorm.weight"] = norm.norm_weight
        tensors["o_proj.bias"] = source.o_bias.to(f64) if source.o_bias is not None else torch.zeros(D, dtype=f64)
    else:
        # --- 3'. portable: unit-RMS latent (far above any eps), norm weight calibrated ----------
        input_scale = source.input_norm_weight.to(f64)
        sample = None if stats.input_sample is None else stats.input_sample.to(f64)
        if plan.stabilizer_channels:
            if sample is None:
                raise ValueError("the stabilized kv_a_layernorm needs calibration statistics")
            norm = stabilized_norm(down, cov, sample, plan.stabilizer_channels)
        else:
            norm = calibrated_norm(down, cov, None if cov is not None else input_scale, sample, plan.norm_calibration)
        down = down / norm.latent_scale
        up_k, up_v = up_k * norm.latent_scale, up_v * norm.latent_scale
        if norm.stabilizer is not None:  # extra latent rows that kv_b_proj never reads
            down = torch.cat([down, norm.stabilizer.to(f64)], dim=0)  # (r+k, D)
            zeros = torch.zeros(H, d, norm.stabilizer.shape[0], dtype=f64)
            up_k, up_v = torch.cat([up_k, zeros], dim=2), torch.cat([up_v, zeros], dim=2)
        kv_a_w = torch.cat([down, k_rope_w], dim=0)  # (r_cfg+d_r, D)
        tensors["kv_a_layernorm.weight"] = norm.weight
        for name, bias in (("q", q_b), ("k_rope", k_b), ("v", v_b), ("o", source.o_bias)):
            if bias is not None and float(bias.abs().max()) > 0:
                dropped.append(name)

    # per query head: kv_b rows [k_nope (d) ; v (d)] from its group
    kv_b = torch.cat([up_k, up_v], dim=1)  # (H, 2d, r_cfg)
    tensors["kv_a_proj_with_mqa.weight"] = kv_a_w
    tensors["kv_b_proj.weight"] = kv_b.reshape(H * 2 * d, -1)
    tensors["o_proj.weight"] = source.o_weight.to(f64)

    if exact and plan.use_q_lora:
        # q = q_b(norm(q_a x + b)): q_a = [I; 0] with bias [0; B], the neutralised norm, q_b = [W_q, b_q]
        q_norm = neutralised_norm(D + 1, plan.dtype)
        tensors["q_a_proj.weight"] = torch.cat([torch.eye(D, dtype=f64), torch.zeros(1, D, dtype=f64)])
        tensors["q_a_proj.bias"] = torch.cat([torch.zeros(D, dtype=f64), q_norm.bias_value.to(f64).view(1)])
        tensors["q_a_layernorm.weight"] = q_norm.norm_weight
        bias_column = (q_target_b if q_target_b is not None else torch.zeros(H, d + d_r, dtype=f64)).reshape(-1, 1)
        tensors["q_b_proj.weight"] = torch.cat(
            [q_target_w.reshape(H * (d + d_r), D) / q_norm.real_scale, bias_column / q_norm.constant_value], dim=1
        )
    else:
        tensors["q_proj.weight"] = q_target_w.reshape(H * (d + d_r), D)
        if q_target_b is not None and exact:
            raise ValueError("a q bias in the exact profile needs use_q_lora=True")

    key_energy = float((k_w * k_w).sum()) if cov is None else float(torch.einsum("gdi,ij,gdj->", k_w, cov, k_w))
    rope_energy = float((k_rope_w * k_rope_w).sum()) if cov is None else float(torch.einsum("ri,ij,rj->", k_rope_w, cov, k_rope_w))
    report = {
        "kv_lora_rank": plan.kv_lora_rank,
        "latent_rank": r,
        "rope_pairs": list(plan.rope_pairs),
        "rope_key_energy_fraction": rope_energy / key_energy if key_energy > 0 else 0.0,
        "k_rel_error": key_error,
        "v_rel_error": value_error,
    }
    out = {name: tensor.to(plan.dtype).contiguous() for name, tensor in tensors.items()}
    return ConvertedAttention(tensors=out, report=report, dropped_biases=dropped)
