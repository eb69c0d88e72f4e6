"""The package's one RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

Dtype semantics (docs/generate.md):

- the mean of squares, the reciprocal square root and the normalisation always run in float32, whatever the
  input dtype (bf16/fp16 activations would lose the small mean of squares otherwise);
- by default the normalised values are cast back to ``x.dtype`` *before* the multiplication by ``weight``,
  which is what transformers' RMSNorms (Llama, Qwen2, Mistral, DeepSeek-V3) compute, so the latent-cache
  model's logits equal transformers' bit for bit in float32 and to rounding in bf16; the result has the dtype
  of ``weight * x`` (``x.dtype`` when the weight is stored in the same dtype);
- ``keep_float32=True`` skips that cast: the float32 normalised values are scaled by ``weight`` and the
  result stays float32 (or wider, if the weight is). Calibration statistics use it. For a float32 ``x`` the
  two modes are identical.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, keep_float32: bool = False) -> torch.Tensor:
    """x (..., D), weight (D,) -> (..., D), normalised over the last dimension (see the module docstring)."""
    x32 = x.float()
    normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if keep_float32:
        return weight * normalised
    return weight * normalised.to(x.dtype)


def latent_scale_ratio(norm_weight: torch.Tensor, reference_weight: torch.Tensor) -> float:
    """How much larger a latent norm's output is than the hidden state its layer's projections read: the RMS of the
    latent norm's weight over that of the layer's input norm (both normalise to unit RMS, so their weights set the
    scales); 0 where either weight is all zeros. An up-projection reading a latent s times larger than the other
    projections' inputs changes its output s times faster under AdamW, whose steps are about the learning rate
    whatever the weights' scale (docs/recover.md, "Stability"): ``W_up (w * n(c)) = (s W_up) ((w / s) * n(c))``
    moves s into the up-projection and leaves the function unchanged."""
    norm_rms = float(norm_weight.detach().double().pow(2).mean().sqrt())
    reference_rms = float(reference_weight.detach().double().pow(2).mean().sqrt())
    return norm_rms / reference_rms if norm_rms > 0 and reference_rms > 0 else 0.0


def normalises(down_weight: torch.Tensor, down_bias: torch.Tensor | None, channels: int) -> bool:
    """Whether a latent norm really normalises its first ``channels`` inputs: not when a constant channel (a zero
    weight row with a bias) dominates the RMS it divides by, as in the exact profile's neutralised norm
    (mha2mla/convert/steps/norm.py), which passes the latent through at its own scale."""
    if down_bias is None:
        return True
    rows, bias = down_weight[:channels].detach(), down_bias[:channels].detach()
    constant = (rows == 0).all(dim=1) & (bias != 0)
    return not bool(constant.any())
