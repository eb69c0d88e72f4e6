"""Step 2 of the conversion (docs/design.md §3.2): joint low rank of the stacked [K_nope; V] projections.

``M`` stacks the NoPE key rows and the value rows of all KV heads (``[2*G*d, D]``). We look for
``W_up [rows, r]`` and ``W_down [r, D]`` with ``M x ≈ W_up (W_down x)`` on the inputs that matter:

- ``joint_low_rank(..., input_covariance=None)`` — weight-only: the top-r left singular vectors of M
  (inputs modelled isotropic); the fast path, poor at small budgets without recovery.
- ``joint_low_rank(..., input_covariance=Σ)`` — activation PCA: the top-r eigenvectors of ``M Σ Mᵀ``
  with Σ = E[x xᵀ] taken on calibration tokens; the starting point of the next one.
- ``attention_aware_low_rank`` — the calibrated default: the latent refined to what attention reads,
  and one up-projection per query head (docs/calibration.md).

The K rows are scaled by ``balance`` so that keys and values weigh the same, and the inverse is folded
back into the up-projection's K rows. At full rank every method reproduces M exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mha2mla.convert.phases import phase
from mha2mla.convert.steps.reconstruct import FUSED_ADAM_DEVICES
from mha2mla.convert.steps.records import Latent, LayerWork
from mha2mla.convert.steps.registry import register, require

# Adam steps refining the attention-aware latent (enough to converge on SmolLM2: docs/calibration.md)
LATENT_STEPS = 50

THREADS = torch.get_num_threads()  # what the process started with


@contextmanager
def threads(count: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def single_thread():
    """One thread: float64 eigh/svd run far slower on several threads than on one (docs/design.md §3, numerics);
    float32 products inside such a block go back to every thread (``threads(THREADS)``)."""
    return threads(1)


@dataclass
class LowRankFactors:
    up: torch.Tensor  # (rows, r)
    down: torch.Tensor  # (r, D)
    key_relative_error: float
    value_relative_error: float
    energy: torch.Tensor  # (rows,) eigenvalues of the (weighted) problem, descending


def joint_low_rank(
    key_nope: torch.Tensor,
    value: torch.Tensor,
    rank: int,
    input_covariance: torch.Tensor | None = None,
    balance: bool = True,
) -> LowRankFactors:
    """Factor ``[key_nope; value]`` (``[n_k, D]`` and ``[n_v, D]``) to rank ``rank``: the SVD of the
    weights when ``input_covariance`` is None, else the PCA of the outputs over inputs with that
    second moment (errors are computed the same way)."""
    cov = input_covariance
    n_key = key_nope.shape[0]

    def energy(rows: torch.Tensor) -> float:
        if cov is None:
            return float((rows * rows).sum())
        return float(torch.einsum("ij,jk,ik->", rows, cov, rows))

    with single_thread():
        key_energy, value_energy = energy(key_nope), energy(value)
        # guard: at full rope capacity K_nope can be empty or zero
        scale = (value_energy / key_energy) ** 0.5 if balance and key_energy > 1e-12 * max(value_energy, 1e-30) else 1.0
        stacked = torch.cat([key_nope * scale, value], dim=0)  # (rows, D)
        eigenvalues, basis = _leading_output_directions(stacked, cov, rank)  # descending, (rows, r)
        down = basis.T @ stacked  # (r, D)
        up = basis.clone()
        up[:n_key] /= scale  # fold the balance back into the K rows
        reconstruction = up @ down  # (rows, D)
        key_error, value_error = energy(reconstruction[:n_key] - key_nope), energy(reconstruction[n_key:] - value)
        key_total, value_total = energy(key_nope), energy(value)
    return LowRankFactors(
        up=up,
        down=down,
        key_relative_error=(key_error / key_total) ** 0.5 if key_total > 0 else 0.0,
        value_relative_error=(value_error / value_total) ** 0.5 if value_total > 0 else 0.0,
        energy=eigenvalues.clamp_min(0),
    )


def _leading_output_directions(stacked: torch.Tensor, cov: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``rank`` eigenvectors (rows, r) of M Σ Mᵀ (Σ = I when ``cov`` is None) and all its eigenvalues,
    descending. With more rows than inputs (MHA: 2·H·d > D) they come from the D × D problem instead —
    Σ^½ Mᵀ M Σ^½ = V Λ Vᵀ gives M Σ^½ V Λ^-½ — a quarter of the work of the rows × rows one at Llama-2-7B;
    directions of a zero eigenvalue are left zero (they carry nothing)."""
    rows, D = stacked.shape
    if rows <= D:
        moment = stacked @ stacked.T if cov is None else stacked @ cov @ stacked.T  # (rows, rows)
        eigenvalues, eigenvectors = torch.linalg.eigh(moment)  # ascending
        return eigenvalues.flip(0), eigenvectors.flip(1)[:, :rank]
    if cov is None:
        weighted = stacked
    else:
        cov_values, cov_vectors = torch.linalg.eigh(cov)
        weighted = stacked @ (cov_vectors * cov_values.clamp_min(0).sqrt()) @ cov_vectors.T  # M Σ^½
    eigenvalues, vectors = torch.linalg.eigh(weighted.T @ weighted)  # (D,), (D, D) ascending
    eigenvalues, vectors = eigenvalues.flip(0), vectors.flip(1)[:, :rank]
    top = eigenvalues[: vectors.shape[1]]
    nonzero = top > top[0].clamp_min(1e-300) * 1e-12
    basis = (weighted @ vectors) / top.clamp_min(1e-300).sqrt()
    basis[:, ~nonzero] = 0
    if basis.shape[1] < rank:  # a rank beyond D: the remaining directions carry nothing either
        basis = torch.cat([basis, basis.new_zeros(rows, rank - basis.shape[1])], dim=1)
    return torch.cat([eigenvalues, eigenvalues.new_zeros(rows - D)]), basis


def regression_up(rows: torch.Tensor, cov: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The best ``U`` for ``rows x ≈ U (down x)`` over inputs with second moment ``cov``."""
    # a relative ridge on the inputs keeps the regression well posed when ``cov`` is rank-deficient (few
    # calibration tokens): a latent that spans ``rows`` then still reproduces them exactly
    cov = cov + 1e-9 * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    weighted = down @ cov  # (r, D): the one r·D² product, shared by both sides
    gram = weighted @ down.T  # a latent channel that is identically zero (e.g. an empty K) gets U = 0
    return (torch.linalg.pinv(gram, rtol=1e-12, hermitian=True) @ (weighted @ rows.T)).T


def optimise_down(prepared, down: torch.Tensor, steps: int, lr: float = 1e-2, device=None) -> torch.Tensor:
    """Latent rows ``W`` maximising Σ_b w_b · captured_b, where block b (rows T_b, input second moment
    Σ_b, weight w_b) regressed on W x captures tr((WΣ_bWᵀ)⁻¹ W Σ_b T_bᵀ T_b Σ_b Wᵀ). ``prepared`` holds per
    block (Σ_b, A_b = Σ_b T_bᵀ, w_b) in float32: W Σ Tᵀ T Σ Wᵀ = (W A)(W A)ᵀ, a thin product instead of a D × D one.
    The steps run on ``device`` (the layer's calibration device; ``down``'s when None), with no host sync."""
    device = down.device if device is None else torch.device(device)
    prepared = [(cov.to(device), thin.to(device), weight) for cov, thin, weight in prepared]
    q, _ = torch.linalg.qr(down.T)
    latent = q.T.float().to(device).clone().requires_grad_(True)  # orthonormal rows spanning the initial latent
    # solve_ex skips solve's error check and fused Adam (on a GPU) keeps its step count there: no host sync per step
    optimizer = torch.optim.Adam([latent], lr=lr, fused=device.type in FUSED_ADAM_DEVICES)
    for _ in range(steps):
        optimizer.zero_grad()
        captured = 0.0
        for cov, thin, weight in prepared:
            read = latent @ thin  # (r, rows)
            solved = torch.linalg.solve_ex(latent @ cov @ latent.T, read @ read.T, check_errors=False).result
            captured = captured + weight * torch.trace(solved)
        (-captured).backward()
        optimizer.step()
    return latent.detach().to(down.device, down.dtype)


def row_space_basis(k_weight: torch.Tensor, v_weight: torch.Tensor) -> torch.Tensor | None:
    """Orthonormal rows (m, D) spanning the rows of the source's K and V projections, or None when they span
    every input direction (m = D: MHA). Everything the latent has to carry lies in this row space, so the
    per-head moments are taken in its m coordinates (docs/calibration.md, "memory")."""
    rows = torch.cat([k_weight, v_weight]).to(torch.float64)  # (2·G·d, D)
    if rows.shape[0] >= rows.shape[1]:
        return None
    with single_thread():
        _, singular, vh = torch.linalg.svd(rows, full_matrices=False)
    kept = singular > singular[0].clamp_min(1e-300) * 1e-10
    return None if int(kept.sum()) == rows.shape[1] else vh[kept]


def to_basis(rows: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``rows`` (…, D) in the coordinates of ``basis`` (m, D); they must lie in its span."""
    coordinates = rows @ basis.T
    residual = float((rows - coordinates @ basis).norm())
    if residual > 1e-6 * max(float(rows.norm()), 1e-30):
        raise RuntimeError(f"internal error: rows outside the K/V row space (relative residual {residual / float(rows.norm()):.2e})")
    return coordinates


def weighted_energy(rows: torch.Tensor, cov: torch.Tensor) -> float:
    return float(torch.einsum("ij,jk,ik->", rows, cov, rows))


def attention_aware_low_rank(key_nope, value, rank, input_covariance, value_covariances, key_covariances=None,
                             steps: int = LATENT_STEPS, key_row_weight=None, basis=None, device=None):
    """Latent and per-query-head up-projections fitted where the errors are seen.

    A value error reaches the output only through attention averages: head h reads x̄_h,i = Σ_j p_hij x_j,
    so V is fitted on ``value_covariances[h] = E[x̄_h x̄_hᵀ]`` rather than on single tokens. The latent
    ``W`` (shared) starts from the activation PCA and is refined to capture the most of the key
    and value energy per group (each relative to its total); then every query head gets its own
    K and V up-projection by regression on its own statistics — kv_b_proj is per head anyway.
    key_nope, value: (G, d, D); input_covariance (D, D); the per-head covariances (H, m, m) in the
    coordinates of ``basis`` (m, D) — the K/V row space — or (H, D, D) when ``basis`` is None. With a basis the
    latent is sought in that row space, where the activation PCA's latent lies.
    All of it runs on ``device`` (the layer's; None: where ``key_nope`` is), the per-head moments moved there one
    group or head at a time; the factors come back where ``key_nope`` was. Returns (up_k, up_v (H, d, r), down (r, D))."""
    home = key_nope.device  # on a GPU: no float64 factorisation left on one host thread
    place = (lambda t: t) if device is None else (lambda t: None if t is None else t.to(device))
    key_nope, value, input_covariance, key_row_weight = map(place, (key_nope, value, input_covariance, key_row_weight))
    basis = None if basis is None else place(basis).to(key_nope.dtype)
    coordinates = (lambda rows: rows) if basis is None else (lambda rows: to_basis(rows, basis))
    up_k, up_v, down = _attention_aware_low_rank(
        coordinates(key_nope), coordinates(value), rank,
        input_covariance if basis is None else basis @ input_covariance @ basis.T,
        value_covariances, key_covariances, steps, key_row_weight)
    return up_k.to(home), up_v.to(home), (down if basis is None else down @ basis).to(home)


def _attention_aware_low_rank(key_nope, value, rank, input_covariance, value_covariances, key_covariances, steps,
                              key_row_weight):
    """attention_aware_low_rank in the coordinates given, on ``key_nope``'s device."""
    device = key_nope.device
    G, d, D = value.shape
    H = value_covariances.shape[0]
    per = H // G
    key_covariances = input_covariance.expand(H, D, D) if key_covariances is None else key_covariances
    dtype = key_nope.dtype  # per-head moments may come in float32 (memory); each is upcast when used
    with single_thread():
        init = joint_low_rank(key_nope.reshape(G * d, D), value.reshape(G * d, D), rank, input_covariance)
        down = init.down
        if rank < int(torch.linalg.matrix_rank(torch.cat([key_nope.reshape(G * d, D), value.reshape(G * d, D)]))):
            key_rows = key_nope if key_row_weight is None else key_nope * key_row_weight[..., None]  # (G, d, D)
            blocks, energy = {"key": [], "value": []}, {"key": 0.0, "value": 0.0}
            for g in range(G):  # one group's float64 mean at a time; the blocks keep float32 (memory.py)
                heads = range(g * per, (g + 1) * per)
                for side, rows, moments in (("key", key_rows[g], key_covariances), ("value", value[g], value_covariances)):
                    group = sum(moments[h].to(device, dtype) for h in heads) / per
                    energy[side] += weighted_energy(rows, group)
                    # one head per group (MHA): its float32 moment itself, not a copy (the same values)
                    same = per == 1 and moments[heads[0]].dtype == torch.float32 and moments.device == device
                    blocks[side].append((moments[heads[0]] if same else group.float(), (group @ rows.T).float()))
            prepared = []
            for g in range(G):
                if energy["key"] > 0:
                    prepared.append((*blocks["key"][g], 1.0 / energy["key"]))
                prepared.append((*blocks["value"][g], 1.0 / energy["value"]))
            with threads(THREADS), phase("refinement"):  # float32 products: every thread
                down = optimise_down(prepared, down, steps, device=device)
        up_k = _head_regressions(key_nope, key_covariances, down, dtype, device)
        up_v = _head_regressions(value, value_covariances, down, dtype, device)
    return up_k, up_v, down


def _head_regressions(rows: torch.Tensor, moments: torch.Tensor, down: torch.Tensor, dtype, device) -> torch.Tensor:
    """(H, d, r): each query head's up-projection of its group's ``rows`` (G, d, m) on its own moment (H, m, m), an
    r·m² product in ``dtype`` each, on ``device`` (None: where the moments are), one head's moment moved at a time."""
    per = moments.shape[0] // rows.shape[0]
    place = (lambda tensor: tensor) if device is None else (lambda tensor: tensor.to(device))
    latent = place(down)
    return torch.stack([regression_up(place(rows[h // per]), place(moments[h]).to(dtype), latent).to(down.device)
                        for h in range(moments.shape[0])])


# ---- lowrank: fills work.latent from the NoPE keys (work.rope) and the values, read as work.query reads them
def _per_head(factors, num_groups: int, num_heads: int) -> Latent:
    """One up-projection per KV group, shared by its query heads."""
    G, per = num_groups, num_heads // num_groups
    rows = factors.up.shape[0] // 2
    up_k = factors.up[:rows].view(G, rows // G, -1).repeat_interleave(per, dim=0)  # (H, d, r)
    up_v = factors.up[rows:].view(G, rows // G, -1).repeat_interleave(per, dim=0)  # (H, d, r)
    return Latent(up_k=up_k, up_v=up_v, down=factors.down)


def _rows(work: LayerWork) -> tuple[torch.Tensor, torch.Tensor]:
    """The NoPE key rows and the value rows, each (G, d, D) in float64."""
    G, d = work.plan.shape.num_kv_heads, work.plan.shape.head_dim
    return work.rope.key_nope_weight, work.source.v_weight.to(torch.float64).view(G, d, -1)


@register("lowrank", "svd")
def svd_latent(work: LayerWork) -> None:
    """Weight-only: the SVD of the stacked [K_nope; V] rows."""
    key_nope, value = _rows(work)
    G, d, D = value.shape
    factors = joint_low_rank(key_nope.reshape(G * d, D), value.reshape(G * d, D), work.plan.latent_rank)
    work.latent = _per_head(factors, G, work.plan.shape.num_heads)


@register("lowrank", "attention", needs_statistics=True)
def attention_latent(work: LayerWork) -> None:
    """The latent refined to what attention reads, per-query-head up-projections (docs/calibration.md)."""
    key_nope, value = _rows(work)
    stats = work.stats
    cov = require(stats.input_covariance, "input covariance", "attention-aware low rank").to(torch.float64)
    values = require(stats.value_covariances, "value covariances", "attention-aware low rank")
    up_k, up_v, down = attention_aware_low_rank(key_nope, value, work.plan.latent_rank, cov, values, stats.key_covariances,
                                                key_row_weight=work.query.key_row_weight, basis=stats.moment_basis,
                                                device=None if work.activations is None else work.activations.device)
    work.latent = Latent(up_k=up_k, up_v=up_v, down=down)
