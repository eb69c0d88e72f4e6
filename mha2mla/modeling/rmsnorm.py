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
