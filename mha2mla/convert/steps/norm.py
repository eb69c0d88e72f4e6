"""Step 3 of the conversion (docs/design.md §2, §3.3): what to do with the RMSNorm that MLA puts on the latent.

``exact`` profile — neutralise it: one extra latent channel has a zero weight row and a large
constant bias B, so the token's RMS is B/sqrt(n) to ~1e-12 relative, and with the norm weight
B/sqrt(n) on the real channels the norm is the identity. The constant channel, normalised to ~1,
then carries biases through the up-projection. The weights are stored in the output dtype, which
rounds them; the scale the stored values really produce is returned so it can be folded into the
up-projection.

``portable`` profile — it cannot be neutralised without a bias, so the latent is scaled to unit
expected RMS (a token with a typical latent passes unchanged, ``unit_rms_norm``) and, with
calibration, extra stabiliser channels keep each token's RMS steady (``stabilized_norm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mha2mla.convert.phases import phase
from mha2mla.convert.steps.records import LatentTensors, LayerWork
from mha2mla.convert.steps.registry import register, require
from mha2mla.modeling.rmsnorm import latent_scale_ratio, normalises


def constant_for(dtype: torch.dtype) -> float:
    """The constant-channel value B: large against the latents, representable in ``dtype``."""
    return 3.0e4 if dtype == torch.float16 else 1.0e6


@dataclass
class NeutralisedNorm:
    bias_value: torch.Tensor  # () the constant channel's bias B, as stored
    norm_weight: torch.Tensor  # (n,) the norm weight, as stored (last entry: the constant channel)
    real_scale: float  # the norm's effective gain on real channels (fold 1/real_scale downstream)
    constant_value: float  # the normalised constant channel's value (fold 1/constant_value downstream)


def neutralised_norm(num_channels: int, dtype: torch.dtype) -> NeutralisedNorm:
    """Norm parameters for ``num_channels`` = real channels + 1 constant channel (the last one)."""
    bias_value = torch.tensor(constant_for(dtype), dtype=torch.float64).to(dtype)
    n = num_channels
    stored_b = float(bias_value.double())
    real_weight = torch.tensor(stored_b / n**0.5, dtype=torch.float64).to(dtype)
    constant_weight = torch.tensor(1.0 / n**0.5, dtype=torch.float64).to(dtype)
    weight = torch.full((n,), float(real_weight.double()), dtype=torch.float64)
    weight[-1] = float(constant_weight.double())
    weight = weight.to(dtype)
    # the RMS the norm sees: dominated by the constant channel (computed in fp32 by transformers)
    rms = (torch.tensor(stored_b, dtype=torch.float32) ** 2 / n).sqrt().double().item()
    return NeutralisedNorm(
        bias_value=bias_value,
        norm_weight=weight,
        real_scale=float(real_weight.double()) / rms,
        constant_value=float(constant_weight.double()) * stored_b / rms,
    )


def expected_rms(down: torch.Tensor, input_covariance: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> float:
    """E-based estimate of a latent's RMS, sqrt(E||W x||² / r), for the portable norm calibration.

    Without activation statistics the attention input is modelled as the input RMSNorm's weight
    times a unit-variance isotropic vector (``input_scale`` = that weight).
    """
    if input_covariance is not None:
        mean_square = torch.einsum("ij,jk,ik->", down, input_covariance, down) / down.shape[0]
    elif input_scale is not None:
        mean_square = ((down * input_scale) ** 2).sum() / down.shape[0]
    else:
        mean_square = (down * down).sum() / down.shape[0]
    return float(mean_square.clamp_min(1e-12) ** 0.5)


@dataclass
class CalibratedNorm:
    latent_scale: float  # divide kv_a's latent rows by it (and multiply kv_b's columns): unit-RMS latents
    weight: torch.Tensor  # (r,) kv_a_layernorm's weight (r + k with stabiliser channels)
    stabilizer: torch.Tensor | None = None  # (k, D) kv_a rows of the stabiliser channels


def unit_rms_norm(down: torch.Tensor, input_covariance: torch.Tensor | None,
                  input_scale: torch.Tensor | None = None) -> CalibratedNorm:
    """The portable kv_a_layernorm without stabiliser channels: the latent rows are divided by the
    expected latent RMS s = sqrt(E‖W x‖² / r) (``expected_rms``) and the norm weight is 1, so a token
    whose latent has the typical RMS passes unchanged."""
    scale = expected_rms(down, input_covariance, input_scale)
    return CalibratedNorm(latent_scale=scale, weight=torch.ones(down.shape[0], dtype=down.dtype))


def stabilized_norm(down: torch.Tensor, input_covariance: torch.Tensor | None, input_sample: torch.Tensor,
                    channels: int = 1, steps: int = 400) -> CalibratedNorm:
    """kv_a_layernorm made nearly the identity with ``channels`` extra latent channels that kv_b_proj
    never reads: their only job is to keep each token's RMS steady.

    The norm divides a token's latent by its RMS. Most tokens' latents have about the same RMS, but
    some do not — above all the attention-sink tokens (the first of a sequence), whose latent is
    several times smaller in deep layers, so a plain norm blows their keys and values up. A
    stabiliser channel s = a·x grows exactly where the real latent is small. Its rows ``a`` and the
    norm weight are fitted on the calibration tokens to minimise the mean *relative* error
    E[‖w ⊙ c/ρ([c; s]) − c‖² / ‖c‖²], which weighs the rare sink tokens as much as they matter.
    """
    scale = expected_rms(down, input_covariance)
    x = input_sample.to(torch.float64)  # (n, D)
    latent = x @ down.T / scale  # (n, r): unit RMS on average
    n, r = latent.shape
    total = r + channels
    energy = latent.pow(2).sum(-1)  # (n,)
    # start: least squares for a stabiliser that tops every token's energy up to a typical level
    target_energy = torch.quantile(energy, 0.9)
    target = (target_energy - energy).clamp_min(0).sqrt()  # (n,)
    ridge = 1e-3 * x.pow(2).mean() * torch.eye(x.shape[1], dtype=x.dtype)
    first = torch.linalg.solve(x.T @ x / n + ridge, x.T @ target / n)  # (D,)
    # the fit runs in float32: faster than float64 on CPU, and the objective is a smooth mean over tokens
    f32 = torch.float32
    rows = torch.zeros(channels, x.shape[1], dtype=f32)
    rows[0] = first.to(f32)
    if channels > 1:
        rows[1:] = 1e-3 * torch.randn(channels - 1, x.shape[1], dtype=f32, generator=torch.Generator().manual_seed(0))
    rows.requires_grad_(True)
    log_weight = torch.zeros(r, dtype=f32, requires_grad=True)
    optimizer = torch.optim.Adam([rows, log_weight], lr=1e-2)

    # per token t, ‖w ⊙ c/ρ − c‖² / ‖c‖² = Σ_j (w_j/ρ − 1)² a_tj with a_tj = c_tj² / ‖c_t‖²: two
    # matrix-vector products per step instead of elementwise work on the (n, r) latent
    share = (latent.pow(2) / energy.clamp_min(1e-12)[:, None]).to(f32)  # (n, r)
    present = share.sum(-1)  # (n,): 1, or 0 for a token whose latent is zero
    x, energy = x.to(f32), energy.to(f32)

    def relative_error():
        stabiliser = x @ rows.T  # (n, k)
        rho = ((energy + stabiliser.pow(2).sum(-1)) / total).sqrt().clamp_min(1e-12)  # (n,)
        weight = log_weight.exp()
        return (share @ weight.pow(2) / rho.pow(2) - 2 * (share @ weight) / rho + present).mean()

    for _ in range(steps):
        optimizer.zero_grad()
        loss = relative_error()
        loss.backward()
        optimizer.step()
    weight = torch.cat([log_weight.detach().exp(), torch.ones(channels, dtype=f32)])
    return CalibratedNorm(latent_scale=scale, weight=weight.to(down.dtype), stabilizer=rows.detach().to(down.dtype))


# ---- kv_norm: fills work.written, the latent side of the target layer
@register("kv_norm", "neutralised", profiles=("exact",), extra_channels=1)
def neutralised_latent(work: LayerWork) -> None:
    """Exact profile: a constant latent channel makes kv_a_layernorm the identity and carries the
    K/V biases through kv_b_proj (docs/design.md §3.3, §3.4)."""
    latent, rope, source = work.latent, work.rope, work.source
    f64 = torch.float64
    H, d, r = latent.up_k.shape
    D = latent.down.shape[1]
    G = rope.key_nope_weight.shape[0]
    norm = neutralised_norm(r + 1, work.plan.torch_dtype)
    kv_a_w = torch.cat([latent.down, torch.zeros(1, D, dtype=f64), rope.key_weight], dim=0)  # (r+1+d_r, D)
    kv_a_b = torch.cat([torch.zeros(r, dtype=f64), norm.bias_value.to(f64).view(1), rope.key_bias])
    const_k = rope.key_nope_bias if rope.key_nope_bias is not None else torch.zeros(G, d, dtype=f64)
    const_v = source.v_bias.to(f64).view(G, d) if source.v_bias is not None else torch.zeros(G, d, dtype=f64)
    const_k, const_v = const_k.repeat_interleave(H // G, 0), const_v.repeat_interleave(H // G, 0)  # (H, d)
    up_k = torch.cat([latent.up_k / norm.real_scale, const_k[:, :, None] / norm.constant_value], dim=2)  # (H, d, r+1)
    up_v = torch.cat([latent.up_v / norm.real_scale, const_v[:, :, None] / norm.constant_value], dim=2)
    o_bias = source.o_bias.to(f64) if source.o_bias is not None else torch.zeros(D, dtype=f64)
    work.written = LatentTensors({
        "kv_a_proj_with_mqa.weight": kv_a_w, "kv_a_proj_with_mqa.bias": kv_a_b, "kv_a_layernorm.weight": norm.norm_weight,
        "kv_b_proj.weight": torch.cat([up_k, up_v], dim=1).reshape(H * 2 * d, r + 1), "o_proj.bias": o_bias,
    })


def _portable_latent(work: LayerWork, norm: CalibratedNorm) -> LatentTensors:
    """Portable profile: unit-RMS latent (far above any eps), the calibrated norm weight, stabiliser
    rows that kv_b_proj never reads; biases cannot be carried and are listed as dropped."""
    latent, rope, source = work.latent, work.rope, work.source
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
def unit_rms_latent(work: LayerWork) -> None:
    """Portable, no extra channel: the latent scaled to unit expected RMS, norm weight 1."""
    cov = None if work.stats.input_covariance is None else work.stats.input_covariance.to(torch.float64)
    input_scale = None if cov is not None else work.source.input_norm_weight.to(torch.float64)
    work.written = _portable_latent(work, unit_rms_norm(work.latent.down, cov, input_scale))


@register("kv_norm", "stabilized", needs_statistics=True, profiles=("portable",), extra_channels=1)
def stabilized_latent(work: LayerWork) -> None:
    """Portable, calibrated: one stabiliser channel keeps each token's latent RMS steady."""
    sample = require(work.stats.input_sample, "input sample", "stabilised kv_a_layernorm").to(torch.float64)
    cov = require(work.stats.input_covariance, "input covariance", "stabilised kv_a_layernorm").to(torch.float64)
    with phase("refinement"):
        fitted = stabilized_norm(work.latent.down, cov, sample, channels=1)
    work.written = _portable_latent(work, fitted)


def balance_latent(tensors: dict[str, torch.Tensor], input_norm_weight: torch.Tensor,
                   kv_lora_rank: int) -> dict[str, torch.Tensor]:
    """The layer's tensors with the latent norm's weight brought to the scale of the layer's input norm and the
    inverse folded into kv_b_proj (rmsnorm.latent_scale_ratio): the same function, and a checkpoint that AdamW can
    fine-tune at the learning rates that suit the other projections, whatever tool trains it (docs/recover.md,
    "Stability"). The factor is the nearest power of two, so that the written values, and the logits, are those of
    the unbalanced layer exactly, in any output dtype. A neutralised norm (exact profile) is left as it is."""
    norm, kv_a, kv_b = (tensors[f"{name}.weight"] for name in ("kv_a_layernorm", "kv_a_proj_with_mqa", "kv_b_proj"))
    if not normalises(kv_a, tensors.get("kv_a_proj_with_mqa.bias"), kv_lora_rank):
        return tensors
    ratio = latent_scale_ratio(norm, input_norm_weight)
    if ratio == 0:
        return tensors
    scale = 2.0 ** round(math.log2(ratio))
    return {**tensors, "kv_a_layernorm.weight": norm / scale, "kv_b_proj.weight": kv_b * scale}
