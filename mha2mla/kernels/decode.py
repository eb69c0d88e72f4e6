"""Triton absorbed decode over the latent cache: split-KV, then a log-sum-exp merge (docs/kernels.md).

Pass 1 (``_decode_split_kernel``), grid (head groups, B, splits): a program owns one slice of one
sequence's cache rows and a group of BLOCK_H heads. For every tile of BLOCK_N cache rows it loads the
latent tile c (BLOCK_N, r) and the rope-key tile (BLOCK_N, d_r) ONCE and uses them for all heads of the
group: scores = q_lat c^T + q_pe k_pe^T (BLOCK_H, BLOCK_N), o_lat += p c. It writes the slice's
normalised o_lat (B, H, S, r) and log-sum-exp (B, H, S), both fp32. The number of slices S comes from
``tuning.decode_num_splits`` (batch x head groups x length against the GPU's multiprocessors).

Pass 2 (``_decode_merge_kernel``), grid (B, H): o_lat = sum_s exp(lse_s - lse) o_s with
lse = logsumexp_s lse_s; empty slices (lse = -inf) weigh nothing.

Nothing here is per-head K or V: the only per-token tensors read are the cache rows (r + d_r values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mha2mla.kernels import tuning
from mha2mla.kernels.backend import interpreting, multiprocessor_count
from mha2mla.kernels.tuning import next_power_of_two

LOG2_E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    QL, QP, C, KP, SEQ_LEN, O_PART, LSE_PART,
    stride_qlb, stride_qlh, stride_qpb, stride_qph,
    stride_cb, stride_ct, stride_kpb, stride_kpt,
    num_heads, rank, d_rope, tokens_per_split, num_splits, scale_log2,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    pid_h = tl.program_id(0)  # fastest axis: the head groups of one cache slice run side by side (L2 reuse)
    b = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,) heads served by this program
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    head_ok = offs_h < num_heads

    q_lat = tl.load(  # (BH, BR) absorbed queries
        QL + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_r[None, :],
        mask=head_ok[:, None] & (offs_r[None, :] < rank), other=0.0)
    q_pe = tl.load(  # (BH, BDR)
        QP + b * stride_qpb + offs_h[:, None] * stride_qph + offs_dr[None, :],
        mask=head_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    seq_len = tl.load(SEQ_LEN + b)
    t_lo = split * tokens_per_split
    t_hi = tl.minimum(seq_len, t_lo + tokens_per_split)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(t_lo, t_hi, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)  # (BN,) cache rows
        row_ok = offs_t < t_hi
        c = tl.load(  # (BN, BR) latent tile, shared by all BLOCK_H heads
            C + b * stride_cb + offs_t[:, None] * stride_ct + offs_r[None, :],
            mask=row_ok[:, None] & (offs_r[None, :] < rank), other=0.0)
        kp = tl.load(  # (BN, BDR) rope-key tile, shared too
            KP + b * stride_kpb + offs_t[:, None] * stride_kpt + offs_dr[None, :],
            mask=row_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            kp = kp.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # (BH, BN)
        s += tl.dot(q_pe, tl.trans(kp), input_precision=PRECISION)
        s = tl.where(row_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)  # (BH, BR)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))  # (BH,) log2 domain
    part_rows = (b * num_heads + offs_h) * num_splits + split  # row of (B, H, S)
    tl.store(O_PART + part_rows[:, None] * rank + offs_r[None, :], acc / l_safe[:, None],
             mask=head_ok[:, None] & (offs_r[None, :] < rank))
    tl.store(LSE_PART + part_rows, lse, mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, O_LAT, LSE, rank, num_splits,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)  # b * H + h
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    lse_max = tl.full([], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        lse_max = tl.maximum(lse_max, tl.load(LSE_PART + pid * num_splits + split))
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for split in range(num_splits):
        lse_s = tl.load(LSE_PART + pid * num_splits + split)
        weight = tl.exp2(lse_s - lse_max_safe)  # 0 for an empty split
        part = tl.load(O_PART + (pid * num_splits + split) * rank + offs_r, mask=r_ok, other=0.0)
        acc += weight * part
        total += weight
    total_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(O_LAT + pid * rank + offs_r, acc / total_safe, mask=r_ok)
    lse_out = tl.where(total == 0.0, float("-inf"), (lse_max_safe + tl.log2(total_safe)) / 1.4426950408889634)
    tl.store(LSE + pid, lse_out)


def mla_decode_latent_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat (B, H, r), q_pe (B, H, d_r), latent (B, T, r), k_pe (B, T, d_r) (views of one cache tensor
    are fine), cache_seqlens (B,) -> o_lat (B, H, r) fp32, lse (B, H) fp32 (natural log)."""
    batch, heads, rank = q_lat.shape
    max_len, d_rope = latent.shape[1], k_pe.shape[2]
    assert latent.shape == (batch, max_len, rank) and k_pe.shape[:2] == (batch, max_len), (latent.shape, k_pe.shape)
    assert q_pe.shape == (batch, heads, d_rope), (q_pe.shape, k_pe.shape)
    assert q_lat.dtype == q_pe.dtype == latent.dtype == k_pe.dtype, "queries and cache must share one dtype"
    for t in (q_lat, q_pe, latent, k_pe):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    block_h, block_n, num_warps = tuning.decode_blocks(heads, rank, interpreting())
    head_groups = triton.cdiv(heads, block_h)
    splits = num_splits or tuning.decode_num_splits(batch, head_groups, max_len, block_n,
                                                    multiprocessor_count(latent.device))
    tokens_per_split = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n  # a multiple of BLOCK_N
    splits = max(1, triton.cdiv(max_len, tokens_per_split))
    seqlens = cache_seqlens.to(device=latent.device, dtype=torch.int32).contiguous()  # (B,)
    o_part = torch.empty(batch, heads, splits, rank, device=latent.device, dtype=torch.float32)  # (B, H, S, r)
    lse_part = torch.empty(batch, heads, splits, device=latent.device, dtype=torch.float32)  # (B, H, S)
    _decode_split_kernel[(head_groups, batch, splits)](
        q_lat, q_pe, latent, k_pe, seqlens, o_part, lse_part,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent.stride(0), latent.stride(1), k_pe.stride(0), k_pe.stride(1),
        heads, rank, d_rope, tokens_per_split, splits, softmax_scale * LOG2_E,
        UPCAST=interpreting(), PRECISION="ieee" if latent.dtype == torch.float32 else "tf32",
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=next_power_of_two(rank), BLOCK_DR=next_power_of_two(d_rope),
        num_warps=num_warps, num_stages=2 if not interpreting() else 1,
    )
    o_lat = torch.empty(batch, heads, rank, device=latent.device, dtype=torch.float32)  # (B, H, r)
    lse = torch.empty(batch, heads, device=latent.device, dtype=torch.float32)  # (B, H)
    _decode_merge_kernel[(batch * heads,)](o_part, lse_part, o_lat, lse, rank, splits, BLOCK_R=next_power_of_two(rank))
    return o_lat, lse
