"""Step 1 of the conversion (docs/design.md §3.1): split RoPE into one shared, decoupled rope key.

Source layout (Hugging Face "half-split"): in a head of dimension d whose first R dims rotate (R = d,
or d × partial_rotary_factor), rotation pair i is the dims (i, i + R/2), rotated at frequency
base^(-2i/R); dims R … d never rotate (already NoPE). The target has d_r/2 pairs on ONE rope key
shared by every query head. The kept pairs are every s-th one from the fastest (pairs 0, s, 2s, …,
s·(d_r/2 − 1)), which map onto plain rope exactly with base' = base^(s·d_r/R). The plan keeps s = 2 when
the rope key has at most a quarter of the rotating dims and s = 1 above (measured with reconstruction,
docs/calibration.md, "rope pairs").

For each kept source pair i the G KV heads' 2-D key components are mixed by an orthogonal G×G
matrix U (the same U on both components of the pair, so it commutes with the rotation). Mixed
component 0 becomes the shared rope key at that frequency, and every query head h takes the
coefficient U[0, group(h)]. What is left of each head's key at that pair (k_g - U[0,g] * k_rope)
loses its rotation and is carried as NoPE content, as are the pairs that are not kept.
"""

from __future__ import annotations

import torch

from mha2mla import UserError


def validate_rope_dim(rotary_dim: int, rope_dim: int) -> None:
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > rotary_dim:
        raise UserError(f"--rope-dim must be an even number between 2 and the {rotary_dim} dims of a head that rotate, "
                        f"not {rope_dim}.")


def validate_rope_stride(rotary_dim: int, rope_dim: int, stride: int) -> None:
    pairs = rope_dim // 2
    if stride < 1 or stride * (pairs - 1) >= rotary_dim // 2:
        largest = (rotary_dim // 2 - 1) // max(1, pairs - 1) if pairs > 1 else rotary_dim // 2
        raise UserError(f"rope_stride {stride} does not fit: {pairs} rope pairs taken every {stride}th would pass the "
                        f"{rotary_dim // 2} pairs a head rotates; use a stride from 1 to {largest}.")


def default_rope_stride(rotary_dim: int, rope_dim: int) -> int:
    """Every other pair when the rope key has at most a quarter of the dims that rotate, else the fastest pairs
    (measured on SmolLM2 with reconstruction: docs/calibration.md, "rope pairs")."""
    return 2 if 4 * rope_dim <= rotary_dim and rope_dim >= 4 else 1


def kept_pairs(rotary_dim: int, rope_dim: int, stride: int = 1) -> list[int]:
    """Source pair indices kept as rope, in target order (target pair j <- source pair stride·j)."""
    validate_rope_dim(rotary_dim, rope_dim)
    validate_rope_stride(rotary_dim, rope_dim, stride)
    return [stride * j for j in range(rope_dim // 2)]


def target_rope_theta(base: float, rotary_dim: int, rope_dim: int, stride: int = 1) -> float:
    """base' such that base'^(-2j/d_r) equals the source frequency base^(-2·stride·j/R) of kept pair j."""
    return float(base) ** (stride * rope_dim / rotary_dim)


def pair_rows(rotary_dim: int, pair: int) -> tuple[int, int]:
    """Rows (within one head) of the two components of rotation pair ``pair`` in the half-split layout."""
    return pair, pair + rotary_dim // 2


def interleaved_order(pairs: list[int], rotary_dim: int) -> list[int]:
    """Source rows of one head, ordered for the target's interleaved (GPT-J) rope layout:
    target rows (2j, 2j+1) hold the two components of kept pair j."""
    rows = []
    for pair in pairs:
        rows.extend(pair_rows(rotary_dim, pair))
    return rows


def second_moment(weight: torch.Tensor, bias: torch.Tensor | None, input_covariance: torch.Tensor | None,
                  input_mean: torch.Tensor | None) -> torch.Tensor:
    """E[y yᵀ] for y = W x + b, from E[x xᵀ] (identity when None: weight-only) and E[x]."""
    moment = weight @ weight.T if input_covariance is None else weight @ input_covariance @ weight.T
    if bias is not None:
        if input_mean is not None:
            cross = torch.outer(weight @ input_mean, bias)
            moment = moment + cross + cross.T
        moment = moment + torch.outer(bias, bias)
    return moment


def head_mixing(
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    pairs: list[int],
    head_dim: int,
    input_covariance: torch.Tensor | None = None,
    input_mean: torch.Tensor | None = None,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Orthogonal mixing matrices U, one per kept pair: ``[P, G, G]``, rows sorted by energy.

    U[p] holds the eigenvectors of the G×G second moment of the heads' key components at pair p
    (summed over the pair's two components), so component 0 captures the most key energy.
    """
    num_groups = k_weight.shape[0] // head_dim
    k_heads = k_weight.view(num_groups, head_dim, -1)  # (G, d, D)
    b_heads = None if k_bias is None else k_bias.view(num_groups, head_dim)  # (G, d)
    mixings = []
    for pair in pairs:
        moment = torch.zeros(num_groups, num_groups, dtype=k_weight.dtype)
        for row in pair_rows(rotary_dim or head_dim, pair):
            w = k_heads[:, row, :]  # (G, D): this component of every KV head
            b = None if b_heads is None else b_heads[:, row]
            moment = moment + second_moment(w, b, input_covariance, input_mean)
        eigenvalues, eigenvectors = torch.linalg.eigh(moment)  # ascending
        mixing = eigenvectors.flip(-1).T  # (G, G): row m = component m, most energetic first
        if mixing[0].sum() < 0:  # a deterministic sign
            mixing[0] = -mixing[0]
        mixings.append(mixing)
    return torch.stack(mixings) if mixings else torch.zeros(0, num_groups, num_groups, dtype=k_weight.dtype)


def rope_coefficients(
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    pairs: list[int],
    head_dim: int,
    input_covariance: torch.Tensor | None = None,
    input_mean: torch.Tensor | None = None,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per kept pair p: the rope key is ``k_rope = Σ_g b[p, g] k_g`` and query head h (group g) reads it
    with coefficient ``a[p, g]``; ``k_g - a[p, g] k_rope`` is left to the NoPE part. Returns ``(b, a)``,
    each ``[P, G]``: the orthogonal mixing of :func:`head_mixing` (a = b = U[p, 0]). For G = 1 both
    are 1 (exact)."""
    mixing = head_mixing(k_weight, k_bias, pairs, head_dim, input_covariance, input_mean, rotary_dim)
    return mixing[:, 0].clone(), mixing[:, 0].clone()
