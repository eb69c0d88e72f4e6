"""What calibration hands the conversion: one layer's activation statistics, and the interface of
the object that produces them (docs/calibration.md).

The pipeline drives a :class:`CalibrationProvider` through named steps per layer, in order:
``statistics(i)`` before layer i is converted, ``refit(i, tensors, source)`` and
``reconstruct(i, tensors, source)`` on the converted layer (when the plan asks for them) and
``advance(i, tensors)`` to push the calibration tokens through layer i. A provider that lacks a step
the plan needs is refused before any work starts (``require_provider``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from mha2mla.convert.layer import SourceAttention


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


@runtime_checkable
class CalibrationProvider(Protocol):
    """The steps of layer-wise calibration (docs/calibration.md, "how statistics are collected")."""

    def statistics(self, layer: int) -> LayerStatistics:
        """Statistics of layer ``layer``'s attention input; layers are asked for in order."""

    def refit(self, layer: int, tensors: dict[str, torch.Tensor], source: SourceAttention) -> tuple[dict[str, torch.Tensor], dict]:
        """The converted layer's read-out refitted towards the source layer ``source`` (canonical weights);
        returns new tensors and a report."""

    def reconstruct(self, layer: int, tensors: dict[str, torch.Tensor], source: SourceAttention) -> tuple[dict[str, torch.Tensor], dict]:
        """The converted layer fitted by gradient descent towards the source layer; new tensors and a report."""

    def advance(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Push the calibration tokens through layer ``layer`` (its converted attention when sequential)."""


def require_provider(provider: object, steps: tuple[str, ...] = ("statistics", "refit", "advance")) -> CalibrationProvider:
    """``provider`` itself, or a TypeError naming the ``steps`` it lacks (nothing is silently skipped)."""
    missing = [step for step in steps if not callable(getattr(provider, step, None))]
    if missing:
        raise TypeError(
            f"a calibration provider needs the methods {', '.join(steps)}; {type(provider).__name__} "
            f"lacks {', '.join(missing)} (see mha2mla.convert.stats.CalibrationProvider)."
        )
    return provider
