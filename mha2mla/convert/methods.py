"""The conversion's methods: one registry of named step functions, and the product's choice of them.

A conversion runs four per-layer steps (docs/design.md §3): ``rope_mixing`` (which mix of the KV
heads becomes the shared rope key), ``rope_compensation`` (what reads the key content that lost its
rotation), ``lowrank`` (the latent and its up-projections) and ``kv_norm`` (what becomes of
kv_a_layernorm), then optionally the calibration ``refit``. Each step's functions are registered
here by name with a uniform signature; ``make_plan`` resolves the names once into a frozen
:class:`Methods`, and ``attention.convert_attention`` looks each one up — nothing downstream decides
by comparing strings.

The product uses exactly two method sets (``product_methods``): the calibrated one, measured best
(docs/benchmarks.md), and the weight-only one (``--calib none``), fast but poor without recovery.
Other combinations are reachable only from Python (``convert(..., methods=Methods(...))``), which is
how ``benchmarks/quality.py`` re-measures the ablations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from mha2mla.convert.layer import Latent, LatentTensors, QueryNope, RopeSplit, SourceAttention
from mha2mla.convert.lowrank import attention_aware_low_rank, joint_low_rank
from mha2mla.convert.norm import CalibratedNorm, neutralised_norm, stabilized_norm, unit_rms_norm
from mha2mla.convert.rope import rope_coefficients
from mha2mla.convert.stats import LayerStatistics

STEP_KINDS = ("rope_mixing", "rope_compensation", "lowrank", "kv_norm")


@dataclass(frozen=True)
class Step:
    function: Callable
    needs_statistics: bool  # reads calibration statistics (fails without them)
    profiles: tuple[str, ...]  # the output profiles it can produce
    extra_channels: int  # latent channels it adds beside the real latent (counted in kv_lora_rank)


STEPS: dict[str, dict[str, Step]] = {kind: {} for kind in STEP_KINDS}


def register(kind: str, name: str, *, needs_statistics: bool = False, profiles=("portable", "exact"), extra_channels: int = 0):
    def decorate(function: Callable) -> Callable:
        STEPS[kind][name] = Step(function, needs_statistics, tuple(profiles), extra_channels)
        return function

    return decorate


def step(kind: str, name: str) -> Step:
    return STEPS[kind][name]


def _require(value, what: str, method: str):
    if value is None:
        raise ValueError(f"the {method} method needs calibration statistics ({what}); convert with calibration")
    return value


# ---- rope_mixing: (k_weight (G*d, D), k_bias (G*d,) | None, pairs, head_dim, rotary_dim, stats) -> (b, a), each (P, G)
@register("rope_mixing", "weight")
def weight_mixing(k_weight, k_bias, pairs, head_dim, rotary_dim, stats: LayerStatistics):
    """Head mixing from the key weights alone (inputs modelled isotropic)."""
    return rope_coefficients(k_weight, k_bias, pairs, head_dim, rotary_dim=rotary_dim)


@register("rope_mixing", "activation", needs_statistics=True)
def activation_mixing(k_weight, k_bias, pairs, head_dim, rotary_dim, stats: LayerStatistics):
    """Head mixing from the keys' second moment on calibration activations."""
    cov = _require(stats.input_covariance, "input covariance", "activation rope mixing").to(torch.float64)
    mean = None if stats.input_mean is None else stats.input_mean.to(torch.float64)
    return rope_coefficients(k_weight, k_bias, pairs, head_dim, cov, mean, rotary_dim=rotary_dim)


# ---- rope_compensation: (q_w (H, d, D), q_b (H, d) | None, num_kv_heads, uses_rope, stats) -> QueryNope
@register("rope_compensation", "none")
def no_compensation(q_w, q_b, num_kv_heads: int, uses_rope: bool, stats: LayerStatistics) -> QueryNope:
    """The whole query head reads the NoPE content as it is."""
    return QueryNope(weight=q_w, bias=q_b)


def mean_rotation(histogram: torch.Tensor, frequencies) -> tuple[torch.Tensor, torch.Tensor]:
    """E[cos Δθ], E[sin Δθ] per head and pair under the distance distribution ``histogram`` (H, L)."""
    histogram = histogram.to(torch.float64)
    histogram = histogram / histogram.sum(-1, keepdim=True).clamp_min(1e-30)
    distance = torch.arange(histogram.shape[-1], dtype=torch.float64)
    angle = distance[:, None] * torch.as_tensor(frequencies, dtype=torch.float64)[None]  # (L, P)
    return histogram @ angle.cos(), histogram @ angle.sin()  # (H, P) each


@register("rope_compensation", "mean", needs_statistics=True)
def mean_compensation(q_w, q_b, num_kv_heads: int, uses_rope: bool, stats: LayerStatistics) -> QueryNope:
    """Query rows whose key lost its rotation read the key through E[R(-Δθ)] instead of the identity.

    With both sides rotated, q_m·k_n = qᵀ R(-Δθ) k for Δ = m - n. Once k loses its rotation (NoPE
    content) the best constant stand-in, over distances weighted by the source's attention, is
    A = E[R(-Δθ)] = [[C, S], [-S, C]]; the query takes Aᵀ q. What survives of each NoPE key row is
    |A|² = C² + S² per pair: the latent's objective weighs the rows by it (``key_row_weight``). Dims that
    never rotate (beyond a partial rotary, or a layer without rope) lost nothing and stay as they are."""
    if not uses_rope:
        return QueryNope(weight=q_w, bias=q_b)
    histogram = _require(stats.distance_histogram, "attention distance histogram", "mean rope compensation")
    C, S = mean_rotation(histogram, stats.pair_frequencies)  # (H, R/2) each
    H, d, _ = q_w.shape
    half = C.shape[1]  # R/2: pair i is rows (i, i + R/2)
    first, second, rest = q_w[:, :half], q_w[:, half : 2 * half], q_w[:, 2 * half :]
    weight = torch.cat([C[..., None] * first - S[..., None] * second, S[..., None] * first + C[..., None] * second, rest], dim=1)
    bias = None
    if q_b is not None:
        b1, b2, b_rest = q_b[:, :half], q_b[:, half : 2 * half], q_b[:, 2 * half :]
        bias = torch.cat([C * b1 - S * b2, S * b1 + C * b2, b_rest], dim=1)
    surviving = (C * C + S * S).view(num_kv_heads, H // num_kv_heads, -1).mean(1).sqrt()  # (G, R/2)
    unrotated = torch.ones(num_kv_heads, d - 2 * half, dtype=surviving.dtype)
    return QueryNope(weight=weight, bias=bias, key_row_weight=torch.cat([surviving, surviving, unrotated], dim=1))


# ---- lowrank: (key_nope (G, d, D), value (G, d, D), rank, num_heads, query, stats) -> Latent
def _per_head(factors, num_groups: int, num_heads: int) -> Latent:
    """One up-projection per KV group, shared by its query heads."""
    G, per = num_groups, num_heads // num_groups
    rows = factors.up.shape[0] // 2
    up_k = factors.up[:rows].view(G, rows // G, -1).repeat_interleave(per, dim=0)  # (H, d, r)
    up_v = factors.up[rows:].view(G, rows // G, -1).repeat_interleave(per, dim=0)  # (H, d, r)
    return Latent(up_k=up_k, up_v=up_v, down=factors.down)


@register("lowrank", "svd")
def svd_latent(key_nope, value, rank, num_heads, query: QueryNope, stats: LayerStatistics) -> Latent:
    """Weight-only: the SVD of the stacked [K_nope; V] rows."""
    G, d, D = value.shape
    return _per_head(joint_low_rank(key_nope.reshape(G * d, D), value.reshape(G * d, D), rank), G, num_heads)


@register("lowrank", "pca", needs_statistics=True)
def pca_latent(key_nope, value, rank, num_heads, query: QueryNope, stats: LayerStatistics) -> Latent:
    """Activation PCA of the stacked [K_nope; V] outputs (a benchmark baseline)."""
    G, d, D = value.shape
    cov = _require(stats.input_covariance, "input covariance", "pca low rank").to(torch.float64)
    return _per_head(joint_low_rank(key_nope.reshape(G * d, D), value.reshape(G * d, D), rank, cov), G, num_heads)


@register("lowrank", "attention", needs_statistics=True)
def attention_latent(key_nope, value, rank, num_heads, query: QueryNope, stats: LayerStatistics) -> Latent:
    """The latent refined to what attention reads, per-query-head up-projections (docs/calibration.md)."""
    cov = _require(stats.input_covariance, "input covariance", "attention-aware low rank").to(torch.float64)
    values = _require(stats.value_covariances, "value covariances", "attention-aware low rank")
    up_k, up_v, down = attention_aware_low_rank(key_nope, value, rank, cov, values, stats.key_covariances,
                                                key_row_weight=query.key_row_weight, basis=stats.moment_basis)
    return Latent(up_k=up_k, up_v=up_v, down=down)


# ---- kv_norm: (latent, rope, source, stats, dtype) -> LatentTensors
@register("kv_norm", "neutralised", profiles=("exact",), extra_channels=1)
def neutralised_latent(latent: Latent, rope: RopeSplit, source: SourceAttention, stats: LayerStatistics,
                       dtype: torch.dtype) -> LatentTensors:
    """Exact profile: a constant latent channel makes kv_a_layernorm the identity and carries the
    K/V biases through kv_b_proj (docs/design.md §3.3, §3.4)."""
    f64 = torch.float64
    H, d, r = latent.up_k.shape
    D = latent.down.shape[1]
    G = rope.key_nope_weight.shape[0]
    norm = neutralised_norm(r + 1, dtype)
    kv_a_w = torch.cat([latent.down, torch.zeros(1, D, dtype=f64), rope.key_weight], dim=0)  # (r+1+d_r, D)
    kv_a_b = torch.cat([torch.zeros(r, dtype=f64), norm.bias_value.to(f64).view(1), rope.key_bias])
    const_k = rope.key_nope_bias if rope.key_nope_bias is not None else torch.zeros(G, d, dtype=f64)
    const_v = source.v_bias.to(f64).view(G, d) if source.v_bias is not None else torch.zeros(G, d, dtype=f64)
    const_k, const_v = const_k.repeat_interleave(H // G, 0), const_v.repeat_interleave(H // G, 0)  # (H, d)
    up_k = torch.cat([latent.up_k / norm.real_scale, const_k[:, :, None] / norm.constant_value], dim=2)  # (H, d, r+1)
    up_v = torch.cat([latent.up_v / norm.real_scale, const_v[:, :, None] / norm.constant_value], dim=2)
    o_bias = source.o_bias.to(f64) if source.o_bias is not None else torch.zeros(D, dtype=f64)
    return LatentTensors({
        "kv_a_proj_with_mqa.weight": kv_a_w, "kv_a_proj_with_mqa.bias": kv_a_b, "kv_a_layernorm.weight": norm.norm_weight,
        "kv_b_proj.weight": torch.cat([up_k, up_v], dim=1).reshape(H * 2 * d, r + 1), "o_proj.bias": o_bias,
    })


def _portable_latent(latent: Latent, rope: RopeSplit, source: SourceAttention, norm: CalibratedNorm) -> LatentTensors:
    """Portable profile: unit-RMS latent (far above any eps), the calibrated norm weight, stabiliser
    rows that kv_b_proj never reads; biases cannot be carried and are listed as dropped."""
    f64 = torch.float64
    H, d, _ = latent.up_k.shape
    down = latent.down / norm.latent_scale
    up_k, up_v = latent.up_k * norm.latent_scale, latent.up_v * norm.latent_scale
    if norm.stabilizer is not None:  # extra latent rows that kv_b_proj never reads
        down = torch.cat([down, norm.stabilizer.to(f64)], dim=0)  # (r+k, D)
        zeros = torch.zeros(H, d, norm.stabilizer.shape[0], dtype=f64)
        up_k, up_v = torch.cat([up_k, zeros], dim=2), torch.cat([up_v, zeros], dim=2)
    dropped = [name for name, bias in (("q", source.q_bias), ("k_rope", source.k_bias), ("v", source.v_bias),
                                       ("o", source.o_bias)) if bias is not None and float(bias.abs().max()) > 0]
    return LatentTensors({
        "kv_a_proj_with_mqa.weight": torch.cat([down, rope.key_weight], dim=0),  # (r_cfg+d_r, D)
        "kv_a_layernorm.weight": norm.weight,
        "kv_b_proj.weight": torch.cat([up_k, up_v], dim=1).reshape(H * 2 * d, -1),  # (H*2d, r_cfg)
    }, dropped)


@register("kv_norm", "rms", profiles=("portable",))
def unit_rms_latent(latent, rope, source, stats: LayerStatistics, dtype) -> LatentTensors:
    """Portable, no extra channel: the latent scaled to unit expected RMS, norm weight 1."""
    cov = None if stats.input_covariance is None else stats.input_covariance.to(torch.float64)
    input_scale = None if cov is not None else source.input_norm_weight.to(torch.float64)
    return _portable_latent(latent, rope, source, unit_rms_norm(latent.down, cov, input_scale))


@register("kv_norm", "stabilized", needs_statistics=True, profiles=("portable",), extra_channels=1)
def stabilized_latent(latent, rope, source, stats: LayerStatistics, dtype) -> LatentTensors:
    """Portable, calibrated: one stabiliser channel keeps each token's latent RMS steady."""
    sample = _require(stats.input_sample, "input sample", "stabilised kv_a_layernorm").to(torch.float64)
    cov = _require(stats.input_covariance, "input covariance", "stabilised kv_a_layernorm").to(torch.float64)
    return _portable_latent(latent, rope, source, stabilized_norm(latent.down, cov, sample, channels=1))


# ---- the resolved choice ------------------------------------------------------------------------
@dataclass(frozen=True)
class Methods:
    """One name per step (see STEPS), the refit, and whether calibration follows the converted model."""

    rope_mixing: str
    rope_compensation: str
    lowrank: str
    kv_norm: str
    refit: bool  # refit V rows and o_proj on the converted layer (calibration.refit)
    sequential: bool  # calibrate layer i+1 on the converted layers' outputs
    reconstruct: bool = False  # then fit the layer by gradient descent to the source layer's output (reconstruct.py)

    def check(self, profile: str) -> None:
        for kind in STEP_KINDS:
            name = getattr(self, kind)
            if name not in STEPS[kind]:
                raise ValueError(f"unknown {kind} method {name!r}; known: {', '.join(STEPS[kind])}")
            if profile not in STEPS[kind][name].profiles:
                raise ValueError(f"the {kind} method {name!r} cannot produce the {profile} profile")

    @property
    def provider_steps(self) -> tuple[str, ...]:
        """The calibration provider's steps these methods call (stats.CalibrationProvider)."""
        return ("statistics", *(["refit"] if self.refit else []), *(["reconstruct"] if self.reconstruct else []), "advance")

    @property
    def needs_statistics(self) -> bool:
        return self.refit or self.reconstruct or any(STEPS[kind][getattr(self, kind)].needs_statistics for kind in STEP_KINDS)

    @property
    def extra_channels(self) -> int:
        return STEPS["kv_norm"][self.kv_norm].extra_channels

    def to_dict(self) -> dict:
        return asdict(self)


def product_methods(profile: str, calibrated: bool, reconstruct: bool = True) -> Methods:
    """The method sets the product offers: calibrated (the default; ``reconstruct=False`` is ``--no-reconstruct``)
    and weight-only."""
    if calibrated:
        return Methods(rope_mixing="activation", rope_compensation="mean", lowrank="attention",
                       kv_norm="neutralised" if profile == "exact" else "stabilized", refit=True, sequential=True,
                       reconstruct=reconstruct)
    return Methods(rope_mixing="weight", rope_compensation="none", lowrank="svd",
                   kv_norm="neutralised" if profile == "exact" else "rms", refit=False, sequential=False)
