"""Step 1 of the conversion (docs/design.md §3.1): split RoPE into one shared, decoupled rope key.

Source layout (Hugging Face "half-split"): in a head of dimension d whose first R dims rotate (R = d,
or d × partial_rotary_factor), rotation pair i is the dims (i, i + R/2), rotated at frequency
base^(-2i/R); dims R … d never rotate (already NoPE). The target has d_r/2 pairs on ONE rope key
shared by every query head. The kept pairs are every s-th one from the fastest (pairs 0, s, 2·s, …,
s·(d_r/2 − 1)), which map onto plain rope exactly with base' = base^(s·d_r/R). The plan keeps s = 2 when
the rope key has at most a quarter of the rotating dims and s = 1 above (docs/calibration.md, "rope pairs").

For each kept source pair i the G KV heads' 2-D key components are mixed by an orthogonal G×G
matrix U (the same U on both components of the pair, so it commutes with the rotation). Mixed
component 0 becomes the shared rope key at that frequency, and every query head h takes the
coefficient U[0, group(h)]. What is left of each head's key at that pair (k_g - U[0,g] * k_rope)
loses its rotation and is carried as NoPE content, as are the pairs that are not kept.
"""

from __future__ import annotations

import torch

from mha2mla import UserError
from mha2mla.convert.steps.records import LayerWork, QueryNope, RopeSplit
from mha2mla.convert.steps.registry import register, require

F64 = torch.float64


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
    (chosen on SmolLM2: docs/benchmarks.md; why: docs/calibration.md, "rope pairs")."""
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


def split_rope(work: LayerWork, covariance: torch.Tensor | None = None, mean: torch.Tensor | None = None) -> RopeSplit:
    """Per kept pair, the shared rope key = a mix of the KV heads' key components (their second moment
    under the input ``covariance``/``mean``, or isotropic inputs); the rest of every head's key loses its
    rotation (docs/design.md §3.1)."""
    source, plan = work.source, work.plan
    H, G, d, R = plan.shape.num_heads, plan.shape.num_kv_heads, plan.shape.head_dim, plan.shape.rotating_dims
    pairs = list(plan.rope_pairs) if source.uses_rope else []  # a layer without rope: its rope key carries nothing
    k_w = source.k_weight.to(F64).view(G, d, -1)  # (G, d, D)
    k_b = None if source.k_bias is None else source.k_bias.to(F64).view(G, d)
    # per kept pair p the rope key is Σ_g b[p, g] k_g and query head h (group g) reads it with a[p, g]: both are
    # component 0 of the orthogonal mixing (a = b = U[p, 0]); for G = 1 both are 1 (exact)
    mixing = head_mixing(source.k_weight.to(F64), None if k_b is None else k_b.reshape(-1), pairs, d, covariance, mean, R)
    key_coeff, query_coeff = mixing[:, 0].clone(), mixing[:, 0].clone()
    rope_w = torch.zeros(plan.rope_dim, k_w.shape[2], dtype=F64)  # (d_r, D): interleaved rows
    rope_b = torch.zeros(plan.rope_dim, dtype=F64)
    nope_w, nope_b = k_w.clone(), None if k_b is None else k_b.clone()
    per_head = torch.zeros(len(plan.rope_pairs), H, dtype=F64)  # (P, H); zero where the layer has no rope
    for j, pair in enumerate(pairs):
        b, a = key_coeff[j], query_coeff[j]  # (G,) rope key = Σ_g b_g k_g; group g reads a_g of it
        for c, row in enumerate(pair_rows(R, pair)):
            rope_w[2 * j + c] = torch.einsum("g,gD->D", b, k_w[:, row, :])
            nope_w[:, row, :] -= a[:, None] * rope_w[2 * j + c]
            if k_b is not None:
                rope_b[2 * j + c] = (b * k_b[:, row]).sum()
                nope_b[:, row] -= a * rope_b[2 * j + c]
        per_head[j] = a.repeat_interleave(H // G)
    return RopeSplit(key_weight=rope_w, key_bias=rope_b, key_nope_weight=nope_w, key_nope_bias=nope_b, query_coeff=per_head)


# ---- rope_mixing: fills work.rope
@register("rope_mixing", "weight")
def weight_mixing(work: LayerWork) -> None:
    """Head mixing from the key weights alone (inputs modelled isotropic)."""
    work.rope = split_rope(work)


@register("rope_mixing", "activation", needs_statistics=True)
def activation_mixing(work: LayerWork) -> None:
    """Head mixing from the keys' second moment on calibration activations."""
    stats = work.stats
    cov = require(stats.input_covariance, "input covariance", "activation rope mixing").to(F64)
    work.rope = split_rope(work, cov, None if stats.input_mean is None else stats.input_mean.to(F64))


# ---- rope_compensation: fills work.query
def _query_heads(work: LayerWork) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The source query rows (H, d, D) and bias (H, d) in float64."""
    H, d = work.plan.shape.num_heads, work.plan.shape.head_dim
    q_b = None if work.source.q_bias is None else work.source.q_bias.to(F64).view(H, d)
    return work.source.q_weight.to(F64).view(H, d, -1), q_b


@register("rope_compensation", "none")
def no_compensation(work: LayerWork) -> None:
    """The whole query head reads the NoPE content as it is."""
    q_w, q_b = _query_heads(work)
    work.query = QueryNope(weight=q_w, bias=q_b)


def mean_rotation(histogram: torch.Tensor, frequencies) -> tuple[torch.Tensor, torch.Tensor]:
    """E[cos Δθ], E[sin Δθ] per head and pair under the distance distribution ``histogram`` (H, L)."""
    histogram = histogram.to(torch.float64)
    histogram = histogram / histogram.sum(-1, keepdim=True).clamp_min(1e-30)
    distance = torch.arange(histogram.shape[-1], dtype=torch.float64)
    angle = distance[:, None] * torch.as_tensor(frequencies, dtype=torch.float64)[None]  # (L, P)
    return histogram @ angle.cos(), histogram @ angle.sin()  # (H, P) each


@register("rope_compensation", "mean", needs_statistics=True)
def mean_compensation(work: LayerWork) -> None:
    """Query rows whose key lost its rotation read the key through E[R(-Δθ)] instead of the identity.

    With both sides rotated, q_m·k_n = qᵀ R(-Δθ) k for Δ = m - n. Once k loses its rotation (NoPE
    content) the best constant stand-in, over distances weighted by the source's attention, is
    A = E[R(-Δθ)] = [[C, S], [-S, C]]; the query takes Aᵀ q. What survives of each NoPE key row is
    |A|² = C² + S² per pair: the latent's objective weighs the rows by it (``key_row_weight``). Dims that
    never rotate (beyond a partial rotary, or a layer without rope) lost nothing and stay as they are."""
    q_w, q_b = _query_heads(work)
    if not work.source.uses_rope:
        work.query = QueryNope(weight=q_w, bias=q_b)
        return
    stats, num_kv_heads = work.stats, work.plan.shape.num_kv_heads
    histogram = require(stats.distance_histogram, "attention distance histogram", "mean rope compensation")
    C, S = mean_rotation(histogram, stats.pair_frequencies)  # (H, R/2) each
    H, d, _ = q_w.shape
    half = C.shape[1]  # R/2: pair i is rows (i, i + R/2)
    first, second, rest = q_w[:, :half], q_w[:, half : 2 * half], q_w[:, 2 * half :]
    weight = torch.cat([C[..., None] * first - S[..., None] * second, S[..., None] * first + C[..., None] * second, rest], dim=1)
    bias = None
    if q_b is not None:
        b1, b2, b_rest = q_b[:, :half], q_b[:, half : 2 * half], q_b[:, 2 * half :]
        bias = torch.cat([C * b1 - S * b2, S * b1 + C * b2, b_rest], dim=1)
    surviving = (C * C + S * S).view(num_kv_heads, H // num_kv_heads, -1).mean(1).sqrt()  # (G, R/2)
    unrotated = torch.ones(num_kv_heads, d - 2 * half, dtype=surviving.dtype)
    work.query = QueryNope(weight=weight, bias=bias, key_row_weight=torch.cat([surviving, surviving, unrotated], dim=1))
