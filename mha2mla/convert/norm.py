"""Step 3 of the conversion (DESIGN §2, §3.3): what to do with an RMSNorm that MLA puts on the latent.

``exact`` profile — neutralise it: one extra latent channel has a zero weight row and a large
constant bias B, so the token's RMS is B/sqrt(n) to ~1e-12 relative, and with the norm weight
B/sqrt(n) on the real channels the norm is the identity. The constant channel, normalised to ~1,
then carries biases through the up-projection. The weights are stored in the output dtype, which
rounds them; the scale the stored values really produce is returned so it can be folded into the
up-projection.

``portable`` profile — calibrate it: the norm weight is set to the expected latent RMS, so a token
with a typical latent passes unchanged; recovery fine-tuning absorbs the per-token deviations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
