"""Triton causal flash attention for MLA training and prefill (docs/kernels.md).

What differs from ordinary flash attention:

* the query/key head dim (d_n + d_r) differs from the value head dim d_v, and none has to be a power
  of two (tiles are padded to a power of two >= 16 and masked);
* the rope key ``k_pe`` (B, Tk, d_r) is ONE tensor shared by all heads: every head program reads the
  same rows (no per-head copy), and its gradient is summed over heads inside the dK/dV program, which
  walks over the heads of its group while keeping the d k_pe tile in registers;
* packed sequences: optional segment ids (query i sees key j only if their segments match); per-row
  bounds (first key of the query's segment, last query of the key's segment) let programs skip tiles;
* causal masking aligned to the end of the keys (query i sits at key position i + Tk - Tq), so the
  same kernel serves prefill after a cache.

Scores are computed in the log2 domain (``scale * log2(e)`` folded in); the forward stores the
per-row log-sum-exp (log2) for the backward, which recomputes probabilities tile by tile (FA2).
Under ``TRITON_INTERPRET=1`` every tile is upcast to fp32 after its load (the interpreter has no bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mha2mla.kernels.backend import interpreting, next_power_of_two

LOG2_E = 1.4426950408889634


@triton.jit
def _flash_mla_fwd_kernel(
    QN, QP, KN, KP, V, O, LSE, QSEG, KSEG, KVLO,
    stride_qb, stride_qh, stride_qt,
    stride_knb, stride_knh, stride_knt,
    stride_kpb, stride_kpt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    num_heads, q_len, k_len, d_nope, d_rope, d_v, scale_log2,
    CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) query rows
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    causal_shift = k_len - q_len

    q_rows = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt  # (BM, 1)
    q_nope = tl.load(QN + q_rows + offs_dn[None, :], mask=row_ok[:, None] & (offs_dn[None, :] < d_nope), other=0.0)
    q_pe = tl.load(QP + q_rows + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (log2 domain), finite on purpose
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, (pid_m + 1) * BLOCK_M + causal_shift)
    if HAS_SEGMENTS:
        q_seg = tl.load(QSEG + b * q_len + offs_m, mask=row_ok, other=-1)
        first_key = tl.load(KVLO + b * q_len + offs_m, mask=row_ok, other=k_len)
        lo = (tl.min(first_key, axis=0) // BLOCK_N) * BLOCK_N

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key columns
        col_ok = offs_n < k_len
        kn_t = tl.load(  # (BDN, BN) key transposed
            KN + b * stride_knb + h * stride_knh + offs_n[None, :] * stride_knt + offs_dn[:, None],
            mask=col_ok[None, :] & (offs_dn[:, None] < d_nope), other=0.0)
        kp_t = tl.load(  # (BDR, BN) the shared rope key: no head offset
            KP + b * stride_kpb + offs_n[None, :] * stride_kpt + offs_dr[:, None],
            mask=col_ok[None, :] & (offs_dr[:, None] < d_rope), other=0.0)
        v = tl.load(  # (BN, BDV)
            V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
        if UPCAST:
            kn_t = kn_t.to(tl.float32)
            kp_t = kp_t.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q_nope, kn_t, input_precision=PRECISION)
        s += tl.dot(q_pe, kp_t, input_precision=PRECISION)
        s = s * scale_log2  # (BM, BN)
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        if HAS_SEGMENTS:
            k_seg = tl.load(KSEG + b * k_len + offs_n, mask=col_ok, other=-2)
            visible = visible & (q_seg[:, None] == k_seg[None, :])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (BM, BN)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows with no visible key output zeros
    acc = acc / l_safe[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < d_v))
    tl.store(LSE + pid_bh * q_len + offs_m, m_i + tl.log2(l_safe), mask=row_ok)


@triton.jit
def _flash_mla_bwd_dkv_kernel(
    QN, QP, KN, KP, V, DO, LSE, DELTA, QSEG, KSEG, QHI, DKN, DKP, DV,
    stride_qb, stride_qh, stride_qt,
    stride_knb, stride_knh, stride_knt,
    stride_kpb, stride_kpt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dknb, stride_dknh, stride_dknt,
    stride_dvb, stride_dvh, stride_dvt,
    num_heads, heads_per_program, q_len, k_len, d_nope, d_rope, d_v, scale_log2, scale,
    CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, ATOMIC_DKP: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One key tile of one sequence, for a group of heads: dK_nope and dV per head, and d k_pe summed
    over the group's heads in registers (one store, or one atomic add per group when heads are split)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    pid_g = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) key rows of this program
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < k_len
    causal_shift = k_len - q_len

    kp = tl.load(  # (BN, BDR) shared rope key, read once for all heads of the group
        KP + b * stride_kpb + offs_n[:, None] * stride_kpt + offs_dr[None, :],
        mask=col_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
    if UPCAST:
        kp = kp.to(tl.float32)
    dkp = tl.zeros([BLOCK_N, BLOCK_DR], dtype=tl.float32)

    lo = 0
    hi = q_len
    if CAUSAL:
        lo = tl.maximum(0, pid_n * BLOCK_N - causal_shift)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_SEGMENTS:
        k_seg = tl.load(KSEG + b * k_len + offs_n, mask=col_ok, other=-2)
        last_query = tl.load(QHI + b * k_len + offs_n, mask=col_ok, other=0)
        hi = tl.minimum(hi, tl.max(last_query, axis=0))

    h_start = pid_g * heads_per_program
    h_end = tl.minimum(num_heads, h_start + heads_per_program)
    for h in range(h_start, h_end):
        kn = tl.load(  # (BN, BDN)
            KN + b * stride_knb + h * stride_knh + offs_n[:, None] * stride_knt + offs_dn[None, :],
            mask=col_ok[:, None] & (offs_dn[None, :] < d_nope), other=0.0)
        v = tl.load(  # (BN, BDV)
            V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
        if UPCAST:
            kn = kn.to(tl.float32)
            v = v.to(tl.float32)
        dkn = tl.zeros([BLOCK_N, BLOCK_DN], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query rows
            row_ok = offs_m < q_len
            q_rows = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt
            qn = tl.load(QN + q_rows + offs_dn[None, :], mask=row_ok[:, None] & (offs_dn[None, :] < d_nope), other=0.0)
            qp = tl.load(QP + q_rows + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
            do = tl.load(
                DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_dv[None, :],
                mask=row_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
            if UPCAST:
                qn = qn.to(tl.float32)
                qp = qp.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + (b * num_heads + h) * q_len + offs_m, mask=row_ok, other=0.0)  # (BM,)
            delta = tl.load(DELTA + (b * num_heads + h) * q_len + offs_m, mask=row_ok, other=0.0)
            s_t = tl.dot(kn, tl.trans(qn), input_precision=PRECISION)  # (BN, BM) scores transposed
            s_t += tl.dot(kp, tl.trans(qp), input_precision=PRECISION)
            visible = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_shift)
            if HAS_SEGMENTS:
                q_seg = tl.load(QSEG + b * q_len + offs_m, mask=row_ok, other=-1)
                visible = visible & (k_seg[:, None] == q_seg[None, :])
            p_t = tl.where(visible, tl.exp2(s_t * scale_log2 - lse[None, :]), 0.0)  # (BN, BM)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BN, BM)
            ds_t = p_t * (dp_t - delta[None, :])
            dkn += tl.dot(ds_t.to(qn.dtype), qn, input_precision=PRECISION)
            dkp += tl.dot(ds_t.to(qp.dtype), qp, input_precision=PRECISION)
        tl.store(
            DKN + b * stride_dknb + h * stride_dknh + offs_n[:, None] * stride_dknt + offs_dn[None, :],
            (dkn * scale).to(DKN.dtype.element_ty), mask=col_ok[:, None] & (offs_dn[None, :] < d_nope))
        tl.store(
            DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :],
            dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < d_v))

    # d k_pe: (B, Tk, d_r) fp32, contiguous
    dkp_ptrs = DKP + b * k_len * d_rope + offs_n[:, None] * d_rope + offs_dr[None, :]
    dkp_mask = col_ok[:, None] & (offs_dr[None, :] < d_rope)
    if ATOMIC_DKP:
        tl.atomic_add(dkp_ptrs, dkp * scale, mask=dkp_mask)
    else:
        tl.store(dkp_ptrs, dkp * scale, mask=dkp_mask)


@triton.jit
def _flash_mla_bwd_dq_kernel(
    QN, QP, KN, KP, V, DO, LSE, DELTA, QSEG, KSEG, KVLO, DQN, DQP,
    stride_qb, stride_qh, stride_qt,
    stride_knb, stride_knh, stride_knt,
    stride_kpb, stride_kpt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    num_heads, q_len, k_len, d_nope, d_rope, d_v, scale_log2, scale,
    CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One query tile of one head: dQ (no-rope and rope parts) by walking the visible key tiles."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    causal_shift = k_len - q_len

    q_rows = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt
    qn = tl.load(QN + q_rows + offs_dn[None, :], mask=row_ok[:, None] & (offs_dn[None, :] < d_nope), other=0.0)
    qp = tl.load(QP + q_rows + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
    if UPCAST:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * q_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * q_len + offs_m, mask=row_ok, other=0.0)
    dqn = tl.zeros([BLOCK_M, BLOCK_DN], dtype=tl.float32)
    dqp = tl.zeros([BLOCK_M, BLOCK_DR], dtype=tl.float32)

    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, (pid_m + 1) * BLOCK_M + causal_shift)
    if HAS_SEGMENTS:
        q_seg = tl.load(QSEG + b * q_len + offs_m, mask=row_ok, other=-1)
        first_key = tl.load(KVLO + b * q_len + offs_m, mask=row_ok, other=k_len)
        lo = (tl.min(first_key, axis=0) // BLOCK_N) * BLOCK_N

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < k_len
        kn = tl.load(  # (BN, BDN)
            KN + b * stride_knb + h * stride_knh + offs_n[:, None] * stride_knt + offs_dn[None, :],
            mask=col_ok[:, None] & (offs_dn[None, :] < d_nope), other=0.0)
        kp = tl.load(  # (BN, BDR) shared rope key
            KP + b * stride_kpb + offs_n[:, None] * stride_kpt + offs_dr[None, :],
            mask=col_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
        v = tl.load(  # (BN, BDV)
            V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
        if UPCAST:
            kn = kn.to(tl.float32)
            kp = kp.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)  # (BM, BN)
        s += tl.dot(qp, tl.trans(kp), input_precision=PRECISION)
        visible = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        if HAS_SEGMENTS:
            k_seg = tl.load(KSEG + b * k_len + offs_n, mask=col_ok, other=-2)
            visible = visible & (q_seg[:, None] == k_seg[None, :])
        p = tl.where(visible, tl.exp2(s * scale_log2 - lse[:, None]), 0.0)  # (BM, BN)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dqn += tl.dot(ds.to(kn.dtype), kn, input_precision=PRECISION)
        dqp += tl.dot(ds.to(kp.dtype), kp, input_precision=PRECISION)

    dq_rows = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt
    tl.store(DQN + dq_rows + offs_dn[None, :], (dqn * scale).to(DQN.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dn[None, :] < d_nope))
    tl.store(DQP + dq_rows + offs_dr[None, :], (dqp * scale).to(DQP.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dr[None, :] < d_rope))


# ------------------------------------------------------------------------------------ host side


@dataclass(frozen=True)
class FlashMLAConfig:
    """Tile sizes. ``heads_per_program`` (dK/dV pass): None picks one from the grid size; fewer heads
    per program than H means several programs add into d k_pe atomically."""

    block_m: int = 64
    block_n: int = 64
    bwd_block_m: int = 32
    bwd_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    heads_per_program: int | None = None


def default_config(d_qk: int, d_v: int) -> FlashMLAConfig:
    if interpreting():
        return FlashMLAConfig(block_m=32, block_n=32, bwd_block_m=16, bwd_block_n=32, num_warps=1, num_stages=1)
    wide = max(d_qk, d_v) > 128
    return FlashMLAConfig(
        block_m=64,
        block_n=64 if not wide else 32,
        bwd_block_m=32,
        bwd_block_n=64 if not wide else 32,
        num_warps=4 if not wide else 8,
        num_stages=2,
    )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def segment_bounds(q_segment_ids: torch.Tensor, k_segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop bounds for packed sequences: first_key[b, i] = first key index in query i's segment (Tk if
    none), last_query[b, j] = 1 + last query index in key j's segment (0 if none). int32 [B, Tq], [B, Tk]."""
    batch, q_len = q_segment_ids.shape
    k_len = k_segment_ids.shape[1]
    _, inverse = torch.unique(torch.cat([q_segment_ids, k_segment_ids], dim=1), return_inverse=True)  # (B, Tq+Tk)
    q_ids, k_ids = inverse[:, :q_len], inverse[:, q_len:]
    slots = q_len + k_len  # an upper bound on the number of distinct ids, no host sync
    device = q_segment_ids.device
    k_index = torch.arange(k_len, device=device).expand(batch, k_len)  # (B, Tk)
    q_index = torch.arange(q_len, device=device).expand(batch, q_len)  # (B, Tq)
    first_key_of_id = torch.full((batch, slots), k_len, device=device, dtype=torch.long)
    first_key_of_id = first_key_of_id.scatter_reduce(1, k_ids, k_index, "amin")  # (B, slots)
    last_query_of_id = torch.full((batch, slots), -1, device=device, dtype=torch.long)
    last_query_of_id = last_query_of_id.scatter_reduce(1, q_ids, q_index, "amax")  # (B, slots)
    first_key = first_key_of_id.gather(1, q_ids).to(torch.int32)  # (B, Tq)
    last_query = (last_query_of_id.gather(1, k_ids) + 1).to(torch.int32)  # (B, Tk)
    return first_key.contiguous(), last_query.contiguous()


def _forward(q, k_nope, k_pe, v, scale, causal, segments, config: FlashMLAConfig):
    batch, heads, q_len, _ = q.shape
    k_len, d_nope, d_rope, d_v = k_nope.shape[2], k_nope.shape[3], k_pe.shape[2], v.shape[3]
    q_nope, q_pe = q[..., :d_nope], q[..., d_nope:]  # views (B, H, Tq, d_n), (B, H, Tq, d_r)
    out = torch.empty(batch, q_len, heads, d_v, device=q.device, dtype=q.dtype).transpose(1, 2)  # (B, H, Tq, d_v)
    lse = torch.empty(batch, heads, q_len, device=q.device, dtype=torch.float32)  # log2 domain
    q_seg, k_seg, first_key, _ = segments
    has_segments = q_seg is not None
    dummy = lse  # never read when HAS_SEGMENTS is False
    grid = (triton.cdiv(q_len, config.block_m), batch * heads)
    _flash_mla_fwd_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, v, out, lse,
        q_seg if has_segments else dummy, k_seg if has_segments else dummy, first_key if has_segments else dummy,
        q.stride(0), q.stride(1), q.stride(2),
        k_nope.stride(0), k_nope.stride(1), k_nope.stride(2),
        k_pe.stride(0), k_pe.stride(1),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, q_len, k_len, d_nope, d_rope, d_v, scale * LOG2_E,
        CAUSAL=causal, HAS_SEGMENTS=has_segments, UPCAST=interpreting(), PRECISION=_precision(q.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_DN=next_power_of_two(d_nope), BLOCK_DR=next_power_of_two(d_rope), BLOCK_DV=next_power_of_two(d_v),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


def _heads_per_program(config: FlashMLAConfig, key_blocks: int, batch: int, heads: int, device) -> int:
    if config.heads_per_program is not None:
        return max(1, min(heads, config.heads_per_program))
    if device.type != "cuda":
        return heads
    programs_wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    groups = min(heads, max(1, triton.cdiv(programs_wanted, key_blocks * batch)))
    return triton.cdiv(heads, groups)


def _backward(dout, q, k_nope, k_pe, v, out, lse, scale, causal, segments, config: FlashMLAConfig):
    batch, heads, q_len, d_qk = q.shape
    k_len, d_nope, d_rope, d_v = k_nope.shape[2], k_nope.shape[3], k_pe.shape[2], v.shape[3]
    dout = _last_dim_contiguous(dout)
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, H, Tq) rowsum(dO * O)
    q_nope, q_pe = q[..., :d_nope], q[..., d_nope:]
    dq = torch.empty(batch, heads, q_len, d_qk, device=q.device, dtype=q.dtype)
    dk_nope = torch.empty(batch, heads, k_len, d_nope, device=q.device, dtype=k_nope.dtype)
    dv = torch.empty(batch, heads, k_len, d_v, device=q.device, dtype=v.dtype)
    q_seg, k_seg, first_key, last_query = segments
    has_segments = q_seg is not None
    dummy = lse
    blocks = {"BLOCK_DN": next_power_of_two(d_nope), "BLOCK_DR": next_power_of_two(d_rope),
              "BLOCK_DV": next_power_of_two(d_v)}
    common = {"UPCAST": interpreting(), "PRECISION": _precision(q.dtype), "num_warps": config.num_warps,
              "num_stages": config.num_stages}

    key_blocks = triton.cdiv(k_len, config.bwd_block_n)
    per_program = _heads_per_program(config, key_blocks, batch, heads, q.device)
    groups = triton.cdiv(heads, per_program)
    atomic = groups > 1
    dk_pe = (torch.zeros if atomic else torch.empty)(batch, k_len, d_rope, device=q.device, dtype=torch.float32)
    _flash_mla_bwd_dkv_kernel[(key_blocks, batch, groups)](
        q_nope, q_pe, k_nope, k_pe, v, dout, lse, delta,
        q_seg if has_segments else dummy, k_seg if has_segments else dummy, last_query if has_segments else dummy,
        dk_nope, dk_pe, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k_nope.stride(0), k_nope.stride(1), k_nope.stride(2),
        k_pe.stride(0), k_pe.stride(1),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk_nope.stride(0), dk_nope.stride(1), dk_nope.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        heads, per_program, q_len, k_len, d_nope, d_rope, d_v, scale * LOG2_E, scale,
        CAUSAL=causal, HAS_SEGMENTS=has_segments, ATOMIC_DKP=atomic,
        BLOCK_M=config.bwd_block_m, BLOCK_N=config.bwd_block_n, **blocks, **common,
    )
    _flash_mla_bwd_dq_kernel[(triton.cdiv(q_len, config.bwd_block_n), batch * heads)](
        q_nope, q_pe, k_nope, k_pe, v, dout, lse, delta,
        q_seg if has_segments else dummy, k_seg if has_segments else dummy, first_key if has_segments else dummy,
        dq[..., :d_nope], dq[..., d_nope:],
        q.stride(0), q.stride(1), q.stride(2),
        k_nope.stride(0), k_nope.stride(1), k_nope.stride(2),
        k_pe.stride(0), k_pe.stride(1),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        heads, q_len, k_len, d_nope, d_rope, d_v, scale * LOG2_E, scale,
        CAUSAL=causal, HAS_SEGMENTS=has_segments,
        BLOCK_M=config.bwd_block_n, BLOCK_N=config.bwd_block_m, **blocks, **common,
    )
    return dq, dk_nope, dk_pe.to(k_pe.dtype), dv


class FlashMLAFunction(torch.autograd.Function):
    """out = softmax(scale * (q_nope k_nope^T + q_pe k_pe^T) + mask) v, with k_pe shared by all heads."""

    @staticmethod
    def forward(ctx, q, k_nope, k_pe, v, scale, causal, q_seg, k_seg, first_key, last_query, config):
        segments = (q_seg, k_seg, first_key, last_query)
        out, lse = _forward(q, k_nope, k_pe, v, scale, causal, segments, config)
        ctx.save_for_backward(q, k_nope, k_pe, v, out, lse, q_seg, k_seg, first_key, last_query)
        ctx.scale, ctx.causal, ctx.config = scale, causal, config
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_nope, k_pe, v, out, lse, q_seg, k_seg, first_key, last_query = ctx.saved_tensors
        segments = (q_seg, k_seg, first_key, last_query)
        dq, dk_nope, dk_pe, dv = _backward(dout, q, k_nope, k_pe, v, out, lse, ctx.scale, ctx.causal, segments, ctx.config)
        return dq, dk_nope, dk_pe, dv, None, None, None, None, None, None, None


def flash_mla_triton(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    segment_ids: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    config: FlashMLAConfig | None = None,
) -> torch.Tensor:
    """Triton MLA attention. q (B, H, Tq, d_n + d_r), k_nope (B, H, Tk, d_n), k_pe (B, Tk, d_r),
    v (B, H, Tk, d_v) -> (B, H, Tq, d_v). Any strides with a unit last stride (views are not copied)."""
    batch, heads, q_len, d_qk = q.shape
    k_len = k_nope.shape[2]
    assert k_nope.shape[:2] == (batch, heads) and v.shape[:3] == (batch, heads, k_len), (q.shape, k_nope.shape, v.shape)
    assert k_pe.shape[:2] == (batch, k_len) and d_qk == k_nope.shape[3] + k_pe.shape[2], (q.shape, k_nope.shape, k_pe.shape)
    assert q_len <= k_len, "queries must be the last Tq of the Tk key positions"
    assert q.dtype == k_nope.dtype == k_pe.dtype == v.dtype, "one dtype (ops.flash_mla_attention resolves mixed ones)"
    q, k_nope, k_pe, v = (_last_dim_contiguous(t) for t in (q, k_nope, k_pe, v))
    config = config or default_config(d_qk, v.shape[3])
    q_seg = k_seg = first_key = last_query = None
    if segment_ids is not None:
        k_seg = segment_ids.to(device=q.device, dtype=torch.int32).expand(batch, k_len).contiguous()  # (B, Tk)
        q_seg = (k_seg[:, k_len - q_len :] if q_segment_ids is None else q_segment_ids.to(q.device, torch.int32))
        q_seg = q_seg.expand(batch, q_len).contiguous()  # (B, Tq)
        first_key, last_query = segment_bounds(q_seg, k_seg)
    return FlashMLAFunction.apply(q, k_nope, k_pe, v, float(softmax_scale), bool(causal), q_seg, k_seg, first_key, last_query, config)
