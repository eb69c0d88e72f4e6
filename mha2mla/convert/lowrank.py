"""Step 2 of the conversion (DESIGN §3.2): joint low rank of the stacked [K_nope; V] projections.

``M`` stacks the NoPE key rows and the value rows of all KV heads (``[2*G*d, D]``). We look for
``W_up [rows, r]`` and ``W_down [r, D]`` with ``M x ≈ W_up (W_down x)`` on the inputs that matter:
the optimum for inputs with second moment Σ = E[x xᵀ] projects onto the top-r eigenvectors of
``M Σ Mᵀ`` (weight-only SVD is the case Σ = I). K rows are scaled by ``balance`` before the
eigendecomposition so that keys and values weigh the same; the inverse is folded back into the
up-projection's K rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LowRankFactors:
    up: torch.Tensor  # (rows, r): columns orthonormal up to the K-row balance fold
    down: torch.Tensor  # (r, D)
    key_relative_error: float
    value_relative_error: float
    energy: torch.Tensor  # (rows,) eigenvalues, descending


def joint_low_rank(
    key_nope: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    input_covariance: torch.Tensor | None = None,
    balance: bool = True,
) -> LowRankFactors:
    """Factor ``[key_nope; value]`` (``[n_k, D]`` and ``[n_v, D]``) to rank ``rank``."""
    n_key = key_nope.shape[0]

    def energy(rows: torch.Tensor) -> float:
        if input_covariance is None:
            return float((rows * rows).sum())
        return float(torch.einsum("ij,jk,ik->", rows, input_covariance, rows))

    key_energy, value_energy = energy(key_nope), energy(value)
    # guard: at full rope capacity K_nope can be empty or zero
    scale = (value_energy / key_energy) ** 0.5 if balance and key_energy > 1e-12 * max(value_energy, 1e-30) else 1.0
    stacked = torch.cat([key_nope * scale, value], dim=0)  # (rows, D)
    moment = stacked @ stacked.T if input_covariance is None else stacked @ input_covariance @ stacked.T
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)  # ascending
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
    basis = eigenvectors[:, :rank]  # (rows, r)
    down = basis.T @ stacked  # (r, D)
    up = basis.clone()
    up[:n_key] /= scale  # fold the balance back into the K rows

    reconstruction = up @ down  # (rows, D)
    key_error = energy(reconstruction[:n_key] - key_nope)
    value_error = energy(reconstruction[n_key:] - value)
    return LowRankFactors(
        up=up,
        down=down,
        key_relative_error=(key_error / key_energy) ** 0.5 if key_energy > 0 else 0.0,
        value_relative_error=(value_error / value_energy) ** 0.5 if value_energy > 0 else 0.0,
        energy=eigenvalues.clamp_min(0),
    )
