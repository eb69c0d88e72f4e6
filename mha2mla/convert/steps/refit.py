"""The refit (docs/calibration.md, "the refit"): the converted layer's linear read-out — each query
head's value rows of kv_b_proj, then o_proj — refitted in closed form on what the converted layer
really computes, towards the source model's outputs.

For query head h the converted layer averages its own latents c with its own probabilities p':
f_hi = Σ_j p'_hij c_j. The source head output is t_hi = Σ_j p_hij v_j. The value rows U_h are fitted
so that U_h f_h ≈ t_h, then o_proj from the refitted heads (U_h f_h)_h to the source attention output
y = W_o t. Moments are accumulated over the calibration sequences in two folds (even and odd
sequences); each map is a ridge regression towards the current one with the ridge chosen by two-fold
cross-validation (``ridge_refit``; keeping the current map is one of the choices).

Two passes over the calibration sequences: the value rows first (``ValueMoments``), then o_proj on the
refitted heads' outputs (``OutputMoments``): its moments are (H·d)² — 0.5 GB in float64 at 70B widths —
where moments of the latents themselves would be (H·r)², 11 GB per fold.
"""

from __future__ import annotations

import torch

from mha2mla.convert.steps.lowrank import single_thread
from mha2mla.convert.steps.records import LayerWork
from mha2mla.convert.steps.registry import register
from mha2mla.modeling.eager import eager_attention

# relative ridges (towards the current map) that the refit chooses from by cross-validation
REFIT_RIDGES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
F64 = torch.float64


class ValueMoments:
    """Two folds of the value refit's moments, in float64, per head: E[t fᵀ] (H, d, r), E[f fᵀ] (H, r, r), E‖t‖²."""

    def __init__(self, num_heads: int, head_dim: int, rank: int, device):
        H, d, r = num_heads, head_dim, rank
        self.cross = torch.zeros(2, H, d, r, dtype=F64, device=device)
        self.gram = torch.zeros(2, H, r, r, dtype=F64, device=device)
        self.energy = torch.zeros(2, dtype=F64, device=device)

    def add(self, fold: int, t: torch.Tensor, f: torch.Tensor) -> None:
        """t (b, H, L, d) source head outputs, f (b, H, L, r) converted averages."""
        self.cross[fold] += torch.einsum("bhld,bhlr->hdr", t, f).double()
        self.gram[fold] += torch.einsum("bhlr,bhls->hrs", f, f).double()
        self.energy[fold] += t.pow(2).sum().double()

    def solve(self, kv_b: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The refitted value rows (H, d, r) of ``kv_b`` (H·2d, r) and the report."""
        H, d, r = self.cross.shape[1:]
        current = kv_b.to(self.cross.device, F64).view(H, 2 * d, r)[:, d:]
        values, report = ridge_refit(current, self.cross, self.gram, self.energy)  # on the moments' device
        return values.cpu(), {"v_output_error": report["error"], "v_output_error_refit": report["error_refit"],
                        "v_refit_ridge": report["ridge"]}


class OutputMoments:
    """Two folds of the o_proj refit's moments, in float64: E[y zᵀ] (D, H·d), E[z zᵀ] (H·d, H·d), E‖y‖², for the
    refitted heads' outputs z = (U_h f_h)_h — the width of o_proj's input, whatever the latent rank."""

    def __init__(self, hidden: int, width: int, device):
        self.cross = torch.zeros(2, hidden, width, dtype=F64, device=device)
        self.gram = torch.zeros(2, width, width, dtype=F64, device=device)
        self.energy = torch.zeros(2, dtype=F64, device=device)

    def add(self, fold: int, z: torch.Tensor, y: torch.Tensor) -> None:
        """z (b, L, H·d) the refitted heads' outputs, y (b, L, D) the source attention output."""
        z_rows, y_rows = z.reshape(-1, z.shape[-1]), y.reshape(-1, y.shape[-1])
        self.cross[fold] += (y_rows.T @ z_rows).double()
        self.gram[fold] += (z_rows.T @ z_rows).double()
        self.energy[fold] += y_rows.pow(2).sum().double()

    def solve(self, o_weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The refitted o_proj (D, H·d) and the report."""
        refitted, report = ridge_refit(o_weight.to(self.cross.device, F64)[None], self.cross[:, None],
                                       self.gram[:, None], self.energy)  # on the moments' device
        return refitted[0].cpu(), {"o_output_error": report["error"], "o_output_error_refit": report["error_refit"],
                             "o_refit_ridge": report["ridge"]}


def ridge_refit(current: torch.Tensor, cross: torch.Tensor, gram: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Least-squares maps U (batched over a leading dim) for t ≈ U f, from two folds of moments:
    ``cross`` (2, B, m, n) = E[t fᵀ], ``gram`` (2, B, n, n) = E[f fᵀ], ``energy`` (2,) = E‖t‖² summed over B.
    The ridge (towards ``current`` (B, m, n)) is the one of REFIT_RIDGES with the least error on
    the fold it was not fitted on — or no refit, when that validates best. Returns U and the relative
    errors before and after (on both folds) and the ridge (None: kept ``current``)."""
    # One eigendecomposition per set of moments serves every ridge: with G = Q Λ Qᵀ the fit is
    # U(λ) = current + R D_λ Qᵀ, R = (C − current G) Q, D_λ = diag(1 / (Λ + λ s)); and the error of U(λ) on
    # moments (C', G', e') is E'(current) + 2 Σ_j D_j a_j + Σ_jl D_j D_l (M ⊙ S)_jl with a = diag(Pᵀ R),
    # P = (current G' − C') Q, M = Qᵀ G' Q, S = Rᵀ R — a few n³ products per fold, then O(n²) per ridge
    # (the o_proj refit at 70B widths has n = 8,192).
    def error(up, moments_cross, moments_gram, moments_energy):  # Σ_B E‖U f − t‖²
        return float(((up @ moments_gram) * up).sum() - 2 * (up * moments_cross).sum() + moments_energy)

    def solver(moments_cross, moments_gram):
        with single_thread():  # float64 eigh (lowrank.single_thread)
            eigenvalues, vectors = torch.linalg.eigh(moments_gram)  # (B, n), (B, n, n)
        scale = moments_gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None]  # (B, 1)
        rotated = (moments_cross - current @ moments_gram) @ vectors  # (B, m, n): R
        return eigenvalues.clamp_min(0), vectors, scale, rotated

    def diagonal(ridge, eigenvalues, scale):  # (B, n)
        return 1.0 / (eigenvalues + ridge * scale)

    def scorer(solved, other_cross, other_gram, other_energy):
        eigenvalues, vectors, scale, rotated = solved
        base = error(current, other_cross, other_gram, other_energy)
        linear = (((current @ other_gram - other_cross) @ vectors) * rotated).sum(-2)  # (B, n): a
        quadratic = (vectors.transpose(1, 2) @ other_gram @ vectors) * (rotated.transpose(1, 2) @ rotated)  # M ⊙ S
        return lambda ridge: base + float(2 * (diagonal(ridge, eigenvalues, scale) * linear).sum() + torch.einsum(
            "bj,bjl,bl->", diagonal(ridge, eigenvalues, scale), quadratic, diagonal(ridge, eigenvalues, scale)))

    folds = [solver(cross[k], gram[k]) for k in (0, 1)]
    held_out = [scorer(folds[k], cross[1 - k], gram[1 - k], energy[1 - k]) for k in (0, 1)]
    before = error(current, cross.sum(0), gram.sum(0), energy.sum())
    scores = {float("inf"): before}  # first: a tie keeps the current map
    scores.update({ridge: held_out[0](ridge) + held_out[1](ridge) for ridge in REFIT_RIDGES})
    ridge = min(scores, key=scores.get)
    refitted, after = current, before
    if ridge != float("inf"):
        eigenvalues, vectors, scale, rotated = solver(cross.sum(0), gram.sum(0))
        refitted = current + (rotated * diagonal(ridge, eigenvalues, scale)[:, None, :]) @ vectors.transpose(1, 2)
        after = error(refitted, cross.sum(0), gram.sum(0), energy.sum())
    total = float(energy.sum().clamp_min(1e-30))
    report = {"error": (max(before, 0.0) / total) ** 0.5, "error_refit": (max(after, 0.0) / total) ** 0.5,
              "ridge": None if ridge == float("inf") else ridge}
    return refitted, report


# the refit keeps its first pass's latents and targets for the second when they take at most this much
REFIT_CACHE_BYTES = 512 * 1024**2


def refit_cache_bytes(tokens: int, heads: int, rank: int, hidden: int) -> int:
    """What the refit keeps of its first pass for the second (averaged latents and targets, float32):
    their size when at most REFIT_CACHE_BYTES, else 0 (the second pass computes them again)."""
    size = tokens * (heads * rank + hidden) * 4
    return size if size <= REFIT_CACHE_BYTES else 0


@register("refit", "ridge", needs_activations=True)
@torch.no_grad()
def ridge_refit_step(work: LayerWork) -> None:
    """The converted layer's value rows and o_proj refitted on what it computes, in two passes: the value rows,
    then o_proj on the refitted heads. f always comes from the stream being calibrated; t from the source
    stream when there is one. A full-capacity conversion, where f spans t exactly, keeps its maps."""
    activations, tensors = work.activations, work.tensors
    target = activations.target_attention(tensors)
    H, d, r = target.num_heads, target.v_head_dim, target.kv_lora_rank
    N, L, D = activations.hidden.shape
    keep = refit_cache_bytes(N * L, H, r, D) > 0  # the first pass's averaged latents and targets, for the second
    kept = []
    value_moments = ValueMoments(H, d, r, activations.device)
    for fold, t, f, y in _readout_batches(work, target, with_output=keep):
        value_moments.add(fold, t, f)
        if keep:
            kept.append((fold, None, f, y))
    values, report = value_moments.solve(tensors["kv_b_proj.weight"])
    up = values.float().to(activations.device)  # (H, d, r)
    output_moments = OutputMoments(D, H * d, activations.device)
    for fold, _, f, y in kept or _readout_batches(work, target, with_output=True):
        z = torch.einsum("hdr,bhlr->blhd", up, f)  # (b, L, H, d): the refitted heads' outputs
        output_moments.add(fold, z.flatten(2), y)
    o_weight, o_report = output_moments.solve(tensors["o_proj.weight"])
    kv_b = tensors["kv_b_proj.weight"].to(F64).view(H, 2 * d, r).clone()
    kv_b[:, d:] = values
    work.tensors = {**tensors, "kv_b_proj.weight": kv_b.reshape(H * 2 * d, r).to(tensors["kv_b_proj.weight"].dtype),
                    "o_proj.weight": o_weight.to(tensors["o_proj.weight"].dtype)}
    work.report.update({**report, **o_report})


def _readout_batches(work: LayerWork, target: torch.nn.Module, with_output: bool):
    """Per half-batch (the two cross-validation folds: even and odd sequences): (fold, t, f, y) with t the source
    heads' outputs (b, H, L, d), f the converted layer's averaged latents (b, H, L, r) and y the source attention
    output (b, L, D; None unless ``with_output``)."""
    activations = work.activations
    stream = activations.stream
    heads = activations.source_heads()  # (N, L, H*d)
    L = activations.hidden.shape[1]
    H, r = target.num_heads, target.kv_lora_rank
    o_weight = work.source.o_weight.float().to(activations.device) if with_output else None  # residual multiplier folded in
    with eager_attention(target.config):
        for batch in activations.batches():
            x = activations.normed(activations.hidden[batch])  # (b, L, D), compute dtype
            b = x.shape[0]
            batch_heads = heads[batch].to(activations.device)  # (b, L, H*d)
            t = batch_heads.view(b, L, H, -1).transpose(1, 2)  # (b, H, L, d)
            p_converted = target(x, position_embeddings=stream.target_rope, attention_mask=stream.causal_mask)[1].float()
            latent = target.kv_a_layernorm(target.kv_a_proj_with_mqa(x)[..., :r]).float()  # (b, L, r)
            f = p_converted @ latent[:, None]  # (b, H, L, r)
            y = batch_heads @ o_weight.T if with_output else None  # (b, L, D)
            for k in (0, 1):
                fold = slice((batch.start + k) % 2, b, 2)
                yield k, t[fold], f[fold], None if y is None else y[fold]
