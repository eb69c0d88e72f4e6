"""Step 2 of the conversion (DESIGN §3.2): joint low rank of the stacked [K_nope; V] projections.

``M`` stacks the NoPE key rows and the value rows of all KV heads (``[2*G*d, D]``). We look for
``W_up [rows, r]`` and ``W_down [r, D]`` with ``M x ≈ W_up (W_down x)`` on the inputs that matter.
Methods (``--lowrank``):

- ``svd`` — weight-only: the top-r left singular vectors of M (inputs modelled isotropic).
- ``pca`` — activation-aware: the top-r eigenvectors of ``M Σ Mᵀ`` with Σ = E[x xᵀ] measured on
  calibration tokens (the PCA of the stacked K/V outputs).
- ``whiten`` — input-whitened SVD: the SVD of ``M L`` with ``L Lᵀ = Σ``. In exact arithmetic it spans
  the same subspace as ``pca`` (``(M L)(M L)ᵀ = M Σ Mᵀ``); it is offered for comparison and because
  it is the form other tools use.
- ``score`` — error measured where it matters: a K error e_k changes the attention score of every
  query head h of its group by q_h·e_k, and a V error e_v changes the output by W_o,h e_v. So the K
  rows of group g are weighted by the query second moment ``Q_g = Σ_h E[q_h q_hᵀ]`` and the V rows by
  the o_proj metric ``O_g = Σ_h W_o,hᵀ W_o,h``: with A = blockdiag(Q_g^½, O_g^½) the PCA runs on
  ``A M`` and the result maps back (``W_up = A⁻¹ B``, ``W_down = Bᵀ A M``). Uses Σ when given.

In every method the K rows (after any metric) are scaled by ``balance`` so that keys and values weigh
the same, and the inverse is folded back into the up-projection's K rows. At full rank every method
reproduces M exactly (A is regularised to be invertible).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

LOWRANK_METHODS = ("svd", "pca", "whiten", "score")
# Adam steps refining the attention-aware latent (converged to ~1e-4 of the objective on SmolLM2)
LATENT_STEPS = 50
# relative floor on a metric's eigenvalues: keeps A invertible (exact full-rank conversions)
METRIC_FLOOR = 1e-6


@contextmanager
def single_thread():
    """float64 eigh/svd on 2 threads can be 100× slower than on 1 (DESIGN §3, numerics)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class LowRankFactors:
    up: torch.Tensor  # (rows, r)
    down: torch.Tensor  # (r, D)
    key_relative_error: float
    value_relative_error: float
    energy: torch.Tensor  # (rows,) eigenvalues of the (weighted) problem, descending


def metric_root(metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, A⁻¹) with A = metric^½ for a symmetric PSD ``[..., d, d]`` metric, eigenvalues floored."""
    eigenvalues, vectors = torch.linalg.eigh(metric)
    floor = METRIC_FLOOR * eigenvalues.clamp_min(0).amax(-1, keepdim=True).clamp_min(1e-30)
    root = eigenvalues.clamp_min(0).maximum(floor).sqrt()  # (..., d)
    a = vectors @ torch.diag_embed(root) @ vectors.transpose(-1, -2)
    a_inv = vectors @ torch.diag_embed(1.0 / root) @ vectors.transpose(-1, -2)
    return a, a_inv


def _block_apply(blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """blockdiag(blocks) @ rows for ``blocks [G, d, d]`` and ``rows [G*d, n]``."""
    G, d, _ = blocks.shape
    return torch.einsum("gij,gjn->gin", blocks, rows.view(G, d, -1)).reshape(G * d, -1)


def joint_low_rank(
    key_nope: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    input_covariance: torch.Tensor | None = None,
    balance: bool = True,
    method: str = "pca",
    key_metric: torch.Tensor | None = None,
    value_metric: torch.Tensor | None = None,
) -> LowRankFactors:
    """Factor ``[key_nope; value]`` (``[n_k, D]`` and ``[n_v, D]``) to rank ``rank``.

    ``method`` is one of LOWRANK_METHODS; ``svd`` ignores ``input_covariance``. ``score`` needs
    ``key_metric`` and ``value_metric`` (``[G, d, d]`` each, G*d = n_k = n_v).
    """
    if method not in LOWRANK_METHODS:
        raise ValueError(f"unknown low-rank method {method!r}")
    cov = None if method == "svd" else input_covariance
    n_key = key_nope.shape[0]

    def energy(rows: torch.Tensor) -> float:
        if cov is None:
            return float((rows * rows).sum())
        return float(torch.einsum("ij,jk,ik->", rows, cov, rows))

    with single_thread():
        key_rows, value_rows = key_nope, value
        if method == "score":
            if key_metric is None or value_metric is None:
                raise ValueError("the score method needs key_metric and value_metric")
            key_root, key_root_inv = metric_root(key_metric)
            value_root, value_root_inv = metric_root(value_metric)
            key_rows, value_rows = _block_apply(key_root, key_nope), _block_apply(value_root, value)

        key_energy, value_energy = energy(key_rows), energy(value_rows)
        # guard: at full rope capacity K_nope can be empty or zero
        scale = (value_energy / key_energy) ** 0.5 if balance and key_energy > 1e-12 * max(value_energy, 1e-30) else 1.0
        stacked = torch.cat([key_rows * scale, value_rows], dim=0)  # (rows, D)
        if method == "whiten" and cov is not None:
            eigenvalues_x, vectors_x = torch.linalg.eigh(cov)
            root = vectors_x * eigenvalues_x.clamp_min(0).sqrt()  # (D, D): root @ rootᵀ = Σ
            left, singular, _ = torch.linalg.svd(stacked @ root, full_matrices=False)
            eigenvalues, eigenvectors = singular**2, left
        else:
            moment = stacked @ stacked.T if cov is None else stacked @ cov @ stacked.T
            eigenvalues, eigenvectors = torch.linalg.eigh(moment)  # ascending
            eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
        basis = eigenvectors[:, :rank]  # (rows, r)
        down = basis.T @ stacked  # (r, D)
        up = basis.clone()
        up[:n_key] /= scale  # fold the balance back into the K rows

        if method == "score":  # map back from the weighted row space
            up = torch.cat([_block_apply(key_root_inv, up[:n_key]), _block_apply(value_root_inv, up[n_key:])])

        def plain_energy(rows: torch.Tensor) -> float:
            if input_covariance is None:
                return float((rows * rows).sum())
            return float(torch.einsum("ij,jk,ik->", rows, input_covariance, rows))

        reconstruction = up @ down  # (rows, D)
        key_error, value_error = plain_energy(reconstruction[:n_key] - key_nope), plain_energy(reconstruction[n_key:] - value)
        key_total, value_total = plain_energy(key_nope), plain_energy(value)
    return LowRankFactors(
        up=up,
        down=down,
        key_relative_error=(key_error / key_total) ** 0.5 if key_total > 0 else 0.0,
        value_relative_error=(value_error / value_total) ** 0.5 if value_total > 0 else 0.0,
        energy=eigenvalues.clamp_min(0),
    )


def regression_up(rows: torch.Tensor, cov: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The best ``U`` for ``rows x ≈ U (down x)`` over inputs with second moment ``cov``."""
    # a relative ridge on the inputs keeps the regression well posed when ``cov`` is rank-deficient (few
    # calibration tokens): a latent that spans ``rows`` then still reproduces them exactly
    cov = cov + 1e-9 * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype)
    gram = down @ cov @ down.T  # a latent channel that is identically zero (e.g. an empty K) gets U = 0
    return (torch.linalg.pinv(gram, rtol=1e-12, hermitian=True) @ (down @ cov @ rows.T)).T


def optimise_down(blocks, down: torch.Tensor, steps: int, lr: float = 1e-2) -> torch.Tensor:
    """Latent rows ``W`` maximising Σ_b w_b · captured_b, where block b (rows T_b, input second moment
    Σ_b, weight w_b) regressed on W x captures tr((WΣ_bWᵀ)⁻¹ W Σ_b T_bᵀ T_b Σ_b Wᵀ)."""
    # W Σ Tᵀ T Σ Wᵀ = (W A)(W A)ᵀ with A = Σ Tᵀ (D × rows): a thin product instead of a D × D one
    prepared = [(cov.float(), (cov @ rows.T).float(), weight) for rows, cov, weight in blocks]
    q, _ = torch.linalg.qr(down.T)
    latent = q.T.float().clone().requires_grad_(True)  # orthonormal rows spanning the initial latent
    optimizer = torch.optim.Adam([latent], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        captured = 0.0
        for cov, thin, weight in prepared:
            read = latent @ thin  # (r, rows)
            captured = captured + weight * torch.trace(torch.linalg.solve(latent @ cov @ latent.T, read @ read.T))
        (-captured).backward()
        optimizer.step()
    return latent.detach().to(down.dtype)


def weighted_energy(rows: torch.Tensor, cov: torch.Tensor) -> float:
    return float(torch.einsum("ij,jk,ik->", rows, cov, rows))


def attention_aware_low_rank(key_nope, value, rank, input_covariance, value_covariances, key_covariances=None,
                             steps: int = LATENT_STEPS, key_row_weight=None):
    """Latent and per-query-head up-projections fitted where the errors are seen.

    A value error reaches the output only through attention averages: head h reads x̄_h,i = Σ_j p_hij x_j,
    so V is fitted on ``value_covariances[h] = E[x̄_h x̄_hᵀ]`` rather than on single tokens. The latent
    ``W`` (shared) starts from the activation PCA and is refined to capture the most of the key
    and value energy per group (each relative to its total); then every query head gets its own
    K and V up-projection by regression on its own statistics — kv_b_proj is per head anyway.
    key_nope, value: (G, d, D); covariances (H, D, D). Returns (up_k (H, d, r), up_v (H, d, r), down (r, D))."""
    G, d, D = value.shape
    H = value_covariances.shape[0]
    per = H // G
    key_covariances = input_covariance.expand(H, D, D) if key_covariances is None else key_covariances
    dtype = key_nope.dtype  # per-head moments may come in float32 (memory); each is upcast when used
    with single_thread():
        init = joint_low_rank(key_nope.reshape(G * d, D), value.reshape(G * d, D), rank, input_covariance)
        down = init.down
        if rank < int(torch.linalg.matrix_rank(torch.cat([key_nope.reshape(G * d, D), value.reshape(G * d, D)]))):
            blocks = []
            group_key = [sum(key_covariances[h].to(dtype) for h in range(g * per, (g + 1) * per)) / per for g in range(G)]
            group_value = [sum(value_covariances[h].to(dtype) for h in range(g * per, (g + 1) * per)) / per for g in range(G)]
            key_rows = key_nope if key_row_weight is None else key_nope * key_row_weight[..., None]  # (G, d, D)
            key_total = sum(weighted_energy(key_rows[g], group_key[g]) for g in range(G))
            value_total = sum(weighted_energy(value[g], group_value[g]) for g in range(G))
            for g in range(G):
                if key_total > 0:
                    blocks.append((key_rows[g], group_key[g], 1.0 / key_total))
                blocks.append((value[g], group_value[g], 1.0 / value_total))
            down = optimise_down(blocks, down, steps)
        up_k = torch.stack([regression_up(key_nope[h // per], key_covariances[h].to(dtype), down) for h in range(H)])
        up_v = torch.stack([regression_up(value[h // per], value_covariances[h].to(dtype), down) for h in range(H)])
    return up_k, up_v, down
