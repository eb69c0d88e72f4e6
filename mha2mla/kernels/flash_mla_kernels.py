"""Triton kernels of the MLA flash attention for training and prefill (docs/kernels.md); the host side that
launches them is ``flash_mla.py``.

What differs from ordinary flash attention:

* the query/key head dim (d_n + d_r) differs from the value head dim d_v, and none has to be a power
  of two (tiles are padded to a power of two >= 16 and masked);
* the rope key ``k_pe`` (B, Tk, d_r) is ONE tensor shared by all heads: every head program reads the
  same rows (no per-head copy), and its gradient is summed over heads inside the dK/dV program, which
  walks over the heads of its group while keeping the d k_pe tile in registers (one partial sum per
  head group, added up after the kernel: no atomics);
* packed sequences: optional segment ids (query i sees key j only if their segments match); per-row
  bounds (first key of the query's segment, last query of the key's segment) let programs skip tiles;
* causal masking aligned to the end of the keys (query i sits at key position i + Tk - Tq), so the
  same kernel serves prefill after a cache.

Scores are computed in the log2 domain (``scale * log2(e)`` folded in); the forward stores the
per-row log-sum-exp (log2) for the backward, which recomputes probabilities tile by tile (FA2).
Under ``TRITON_INTERPRET=1`` every tile is upcast to fp32 after its load (the interpreter has no bf16).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, q_nope, q_pe, kn_base, kp_base, v_base, kseg_row, q_seg, offs_m, start, stop,
    stride_knt, stride_kpt, stride_vt, k_len, d_nope, d_rope, d_v, causal_shift, scale_log2,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The forward's online softmax over the key tiles [start, stop) of one query block; MASKED False for tiles
    every row sees whole (no causal, segment or end-of-keys mask to build)."""
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key columns
        col_ok = offs_n < k_len
        kn_t = tl.load(  # (BDN, BN) key transposed
            kn_base + offs_n[None, :] * stride_knt + offs_dn[:, None],
            mask=col_ok[None, :] & (offs_dn[:, None] < d_nope), other=0.0)
        kp_t = tl.load(  # (BDR, BN) the shared rope key: no head offset
            kp_base + offs_n[None, :] * stride_kpt + offs_dr[:, None],
            mask=col_ok[None, :] & (offs_dr[:, None] < d_rope), other=0.0)
        v = tl.load(  # (BN, BDV)
            v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
        if UPCAST:
            kn_t = kn_t.to(tl.float32)
            kp_t = kp_t.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q_nope, kn_t, input_precision=PRECISION)
        s += tl.dot(q_pe, kp_t, input_precision=PRECISION)
        s = s * scale_log2  # (BM, BN)
        if MASKED:
            visible = col_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
            if HAS_SEGMENTS:
                k_seg = tl.load(kseg_row + offs_n, mask=col_ok, other=-2)
                visible = visible & (q_seg[:, None] == k_seg[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (BM, BN)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


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
        first_key = tl.load(KVLO + b * q_len + offs_m, mask=row_ok, other=k_len)
        lo = (tl.min(first_key, axis=0) // BLOCK_N) * BLOCK_N

    kn_base = KN + b * stride_knb + h * stride_knh
    kp_base = KP + b * stride_kpb
    v_base = V + b * stride_vb + h * stride_vh
    q_seg = offs_m  # read only when HAS_SEGMENTS (set below)
    if HAS_SEGMENTS:
        q_seg = tl.load(QSEG + b * q_len + offs_m, mask=row_ok, other=-1)
    # key tiles every row of this block sees whole (before the diagonal, inside the keys) skip the mask;
    # with segments every tile is masked
    full_hi = lo
    if not HAS_SEGMENTS:
        if CAUSAL:
            full_hi = tl.minimum(hi, ((pid_m * BLOCK_M + causal_shift + 1) // BLOCK_N) * BLOCK_N)
        else:
            full_hi = (k_len // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, q_nope, q_pe, kn_base, kp_base, v_base, KSEG + b * k_len, q_seg, offs_m, lo, full_hi,
        stride_knt, stride_kpt, stride_vt, k_len, d_nope, d_rope, d_v, causal_shift, scale_log2,
        False, CAUSAL, HAS_SEGMENTS, UPCAST, PRECISION, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV)
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, q_nope, q_pe, kn_base, kp_base, v_base, KSEG + b * k_len, q_seg, offs_m, full_hi, hi,
        stride_knt, stride_kpt, stride_vt, k_len, d_nope, d_rope, d_v, causal_shift, scale_log2,
        True, CAUSAL, HAS_SEGMENTS, UPCAST, PRECISION, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows with no visible key output zeros
    acc = acc / l_safe[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < d_v))
    tl.store(LSE + pid_bh * q_len + offs_m, m_i + tl.log2(l_safe), mask=row_ok)


@triton.jit
def _dkv_one_head(
    dkp, kp, h, b, offs_n, col_ok, lo, hi, k_seg,
    QN, QP, KN, V, DO, LSE, DELTA, QSEG, DKN, DV,
    stride_qb, stride_qh, stride_qt,
    stride_knb, stride_knh, stride_knt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dknb, stride_dknh, stride_dknt,
    stride_dvb, stride_dvh, stride_dvt,
    num_heads, q_len, d_nope, d_rope, d_v, causal_shift, scale_log2, scale,
    CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK_nope and dV of head h for one key block (stored), and its rope-key gradient added to dkp."""
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
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
    return dkp


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
    CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ONE_HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One key tile of one sequence, for one head (ONE_HEAD) or a group of heads: dK_nope and dV per head, and
    d k_pe summed over the group's heads in registers, stored as the group's partial sum (groups, B, Tk, d_r): the
    host adds the groups' partials after the kernel, so no two programs write the same rows."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    pid_g = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) key rows of this program
    offs_dr = tl.arange(0, BLOCK_DR)
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
    k_seg = offs_n  # read only when HAS_SEGMENTS
    if HAS_SEGMENTS:
        k_seg = tl.load(KSEG + b * k_len + offs_n, mask=col_ok, other=-2)
        last_query = tl.load(QHI + b * k_len + offs_n, mask=col_ok, other=0)
        hi = tl.minimum(hi, tl.max(last_query, axis=0))

    # one head per program (the host's default on a GPU): no loop over heads, which makes the compiler spill
    # registers (`kernels_bench.py --compile`); else the heads of the group in turn, dkp summed over them
    if ONE_HEAD:
        dkp = _dkv_one_head(
            dkp, kp, pid_g, b, offs_n, col_ok, lo, hi, k_seg,
            QN, QP, KN, V, DO, LSE, DELTA, QSEG, DKN, DV,
            stride_qb, stride_qh, stride_qt, stride_knb, stride_knh, stride_knt, stride_vb, stride_vh, stride_vt,
            stride_dob, stride_doh, stride_dot, stride_dknb, stride_dknh, stride_dknt, stride_dvb, stride_dvh, stride_dvt,
            num_heads, q_len, d_nope, d_rope, d_v, causal_shift, scale_log2, scale,
            CAUSAL, HAS_SEGMENTS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV)
    else:
        h_start = pid_g * heads_per_program
        h_end = tl.minimum(num_heads, h_start + heads_per_program)
        for h in range(h_start, h_end):
            dkp = _dkv_one_head(
                dkp, kp, h, b, offs_n, col_ok, lo, hi, k_seg,
                QN, QP, KN, V, DO, LSE, DELTA, QSEG, DKN, DV,
                stride_qb, stride_qh, stride_qt, stride_knb, stride_knh, stride_knt, stride_vb, stride_vh, stride_vt,
                stride_dob, stride_doh, stride_dot, stride_dknb, stride_dknh, stride_dknt, stride_dvb, stride_dvh, stride_dvt,
                num_heads, q_len, d_nope, d_rope, d_v, causal_shift, scale_log2, scale,
                CAUSAL, HAS_SEGMENTS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV)

    # this group's partial d k_pe: (groups, B, Tk, d_r) fp32, contiguous
    dkp_ptrs = DKP + ((pid_g * tl.num_programs(1) + b) * k_len + offs_n[:, None]) * d_rope + offs_dr[None, :]
    tl.store(dkp_ptrs, dkp * scale, mask=col_ok[:, None] & (offs_dr[None, :] < d_rope))


@triton.jit
def _dq_key_tiles(
    dqn, dqp, qn, qp, do, lse, delta, kn_base, kp_base, v_base, kseg_row, q_seg, offs_m, start, stop,
    stride_knt, stride_kpt, stride_vt, k_len, d_nope, d_rope, d_v, causal_shift, scale_log2,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ over the key tiles [start, stop) of one query tile; MASKED False for tiles every row sees whole."""
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < k_len
        kn = tl.load(  # (BN, BDN)
            kn_base + offs_n[:, None] * stride_knt + offs_dn[None, :],
            mask=col_ok[:, None] & (offs_dn[None, :] < d_nope), other=0.0)
        kp = tl.load(  # (BN, BDR) shared rope key
            kp_base + offs_n[:, None] * stride_kpt + offs_dr[None, :],
            mask=col_ok[:, None] & (offs_dr[None, :] < d_rope), other=0.0)
        v = tl.load(  # (BN, BDV)
            v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < d_v), other=0.0)
        if UPCAST:
            kn = kn.to(tl.float32)
            kp = kp.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)  # (BM, BN)
        s += tl.dot(qp, tl.trans(kp), input_precision=PRECISION)
        p = tl.exp2(s * scale_log2 - lse[:, None])  # (BM, BN)
        if MASKED:
            visible = col_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
            if HAS_SEGMENTS:
                k_seg = tl.load(kseg_row + offs_n, mask=col_ok, other=-2)
                visible = visible & (q_seg[:, None] == k_seg[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dqn += tl.dot(ds.to(kn.dtype), kn, input_precision=PRECISION)
        dqp += tl.dot(ds.to(kp.dtype), kp, input_precision=PRECISION)
    return dqn, dqp


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
    q_seg = offs_m  # read only when HAS_SEGMENTS
    if HAS_SEGMENTS:
        q_seg = tl.load(QSEG + b * q_len + offs_m, mask=row_ok, other=-1)
        first_key = tl.load(KVLO + b * q_len + offs_m, mask=row_ok, other=k_len)
        lo = (tl.min(first_key, axis=0) // BLOCK_N) * BLOCK_N
    full_hi = lo  # key tiles before full_hi need no mask (as in the forward); rows past q_len are never stored
    if not HAS_SEGMENTS:
        if CAUSAL:
            full_hi = tl.minimum(hi, ((pid_m * BLOCK_M + causal_shift + 1) // BLOCK_N) * BLOCK_N)
        else:
            full_hi = (k_len // BLOCK_N) * BLOCK_N
    kn_base = KN + b * stride_knb + h * stride_knh
    kp_base = KP + b * stride_kpb
    v_base = V + b * stride_vb + h * stride_vh
    dqn, dqp = _dq_key_tiles(
        dqn, dqp, qn, qp, do, lse, delta, kn_base, kp_base, v_base, KSEG + b * k_len, q_seg, offs_m, lo, full_hi,
        stride_knt, stride_kpt, stride_vt, k_len, d_nope, d_rope, d_v, causal_shift, scale_log2,
        False, CAUSAL, HAS_SEGMENTS, UPCAST, PRECISION, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV)
    dqn, dqp = _dq_key_tiles(
        dqn, dqp, qn, qp, do, lse, delta, kn_base, kp_base, v_base, KSEG + b * k_len, q_seg, offs_m, full_hi, hi,
        stride_knt, stride_kpt, stride_vt, k_len, d_nope, d_rope, d_v, causal_shift, scale_log2,
        True, CAUSAL, HAS_SEGMENTS, UPCAST, PRECISION, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV)

    dq_rows = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt
    tl.store(DQN + dq_rows + offs_dn[None, :], (dqn * scale).to(DQN.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dn[None, :] < d_nope))
    tl.store(DQP + dq_rows + offs_dr[None, :], (dqp * scale).to(DQP.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dr[None, :] < d_rope))
