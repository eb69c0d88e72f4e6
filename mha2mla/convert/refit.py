"""The refit (docs/calibration.md, "the refit"): the converted layer's linear read-out — each query
head's value rows of kv_b_proj, then o_proj — refitted in closed form on what the converted layer
really computes, towards the source model's outputs.

For query head h the converted layer averages its own latents c with its own probabilities p':
f_hi = Σ_j p'_hij c_j. The source head output is t_hi = Σ_j p_hij v_j. The value rows U_h are fitted
so that U_h f_h ≈ t_h, then o_proj from the refitted heads (U_h f_h)_h to the source attention output
y = W_o t. Moments are accumulated over the calibration sequences in two folds (even and odd
sequences); each map is a ridge regression towards the current one with the ridge chosen by two-fold
cross-validation (``ridge_refit``; keeping the current map is one of the choices).
"""

from __future__ import annotations

import torch

# relative ridges (towards the current map) that the refit chooses from by cross-validation
REFIT_RIDGES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
F64 = torch.float64


class ReadOutMoments:
    """Two folds of the refit's moments, in float64: per head E[t fᵀ] (H, d, r), E[f fᵀ] (H, r, r),
    E‖t‖²; for o_proj E[y f_allᵀ] (D, H·r), E[f_all f_allᵀ] (H·r, H·r), E‖y‖², f_all = (f_h)_h."""

    def __init__(self, num_heads: int, head_dim: int, rank: int, hidden: int, device):
        H, d, r, D = num_heads, head_dim, rank, hidden
        self.cross = torch.zeros(2, H, d, r, dtype=F64, device=device)
        self.gram = torch.zeros(2, H, r, r, dtype=F64, device=device)
        self.energy = torch.zeros(2, dtype=F64, device=device)
        self.o_cross = torch.zeros(2, D, H * r, dtype=F64, device=device)
        self.o_gram = torch.zeros(2, H * r, H * r, dtype=F64, device=device)
        self.o_energy = torch.zeros(2, dtype=F64, device=device)

    def add(self, fold: int, t: torch.Tensor, f: torch.Tensor, y: torch.Tensor) -> None:
        """t (b, H, L, d) source head outputs, f (b, H, L, r) converted averages, y (b, L, D) source output."""
        b, H, L, r = f.shape
        self.cross[fold] += torch.einsum("bhld,bhlr->hdr", t, f).double()
        self.gram[fold] += torch.einsum("bhlr,bhls->hrs", f, f).double()
        self.energy[fold] += t.pow(2).sum().double()
        y_rows, f_rows = y.reshape(-1, y.shape[-1]), f.transpose(1, 2).reshape(b * L, H * r)
        self.o_cross[fold] += (y_rows.T @ f_rows).double()
        self.o_gram[fold] += (f_rows.T @ f_rows).double()
        self.o_energy[fold] += y_rows.pow(2).sum().double()

    def solve(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """The refitted kv_b_proj value rows and o_proj, and the report (errors before/after, ridges)."""
        H, d, r = self.cross.shape[1:]
        kv_b = tensors["kv_b_proj.weight"].to(F64).view(H, 2 * d, r).cpu()
        values, report = ridge_refit(kv_b[:, d:], self.cross.cpu(), self.gram.cpu(), self.energy.cpu())
        kv_b[:, d:] = values
        out = dict(tensors)
        out["kv_b_proj.weight"] = kv_b.reshape(H * 2 * d, r).to(tensors["kv_b_proj.weight"].dtype)
        block = torch.block_diag(*values)  # (H*d, H*r): the refitted heads z = B f_all
        o_gram = block @ self.o_gram.cpu() @ block.T  # (2, H*d, H*d)
        o_cross = self.o_cross.cpu() @ block.T  # (2, D, H*d)
        o_weight = tensors["o_proj.weight"].to(F64).cpu()[None]  # (1, D, H*d)
        o_refitted, o_report = ridge_refit(o_weight, o_cross[:, None], o_gram[:, None], self.o_energy.cpu())
        out["o_proj.weight"] = o_refitted[0].to(tensors["o_proj.weight"].dtype)
        return out, {
            "v_output_error": report["error"], "v_output_error_refit": report["error_refit"], "v_refit_ridge": report["ridge"],
            "o_output_error": o_report["error"], "o_output_error_refit": o_report["error_refit"], "o_refit_ridge": o_report["ridge"],
        }


def ridge_refit(current: torch.Tensor, cross: torch.Tensor, gram: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Least-squares maps U (batched over a leading dim) for t ≈ U f, from two folds of moments:
    ``cross`` (2, B, m, n) = E[t fᵀ], ``gram`` (2, B, n, n) = E[f fᵀ], ``energy`` (2,) = E‖t‖² summed over B.
    The ridge (towards ``current`` (B, m, n)) is the one of REFIT_RIDGES with the least error on
    the fold it was not fitted on — or no refit, when that validates best. Returns U and the relative
    errors before and after (on both folds) and the ridge (None: kept ``current``)."""
    # one eigendecomposition per set of moments serves every ridge: (G + λsI)⁻¹ = Q (Λ + λs)⁻¹ Qᵀ
    def solver(moments_cross, moments_gram):
        eigenvalues, vectors = torch.linalg.eigh(moments_gram)  # (B, n), (B, n, n)
        scale = moments_gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None]  # (B, 1)
        rotated = (moments_cross - current @ moments_gram) @ vectors  # (B, m, n): the residual's cross moment

        def fit(ridge):
            return current + (rotated / (eigenvalues.clamp_min(0) + ridge * scale)[:, None, :]) @ vectors.transpose(1, 2)

        return fit

    def error(up, k):  # Σ_B E‖U f − t‖² on fold k
        return float(torch.einsum("bmr,brs,bms->", up, gram[k], up) - 2 * torch.einsum("bmr,bmr->", up, cross[k]) + energy[k])

    folds = [solver(cross[k], gram[k]) for k in (0, 1)]
    scores = {float("inf"): error(current, 0) + error(current, 1)}  # first: a tie keeps the current map
    scores.update({ridge: sum(error(folds[k](ridge), 1 - k) for k in (0, 1)) for ridge in REFIT_RIDGES})
    ridge = min(scores, key=scores.get)
    refitted = current if ridge == float("inf") else solver(cross.sum(0), gram.sum(0))(ridge)
    total = float(energy.sum().clamp_min(1e-30))
    report = {"error": (max(error(current, 0) + error(current, 1), 0.0) / total) ** 0.5,
              "error_refit": (max(error(refitted, 0) + error(refitted, 1), 0.0) / total) ** 0.5,
              "ridge": None if ridge == float("inf") else ridge}
    return refitted, report
