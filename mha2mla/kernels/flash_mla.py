"""Host side of the Triton MLA flash attention for training and prefill (docs/kernels.md): buffers, grids,
launch settings per shape, and the ``autograd.Function``. The kernels are in ``flash_mla_kernels.py``."""

from __future__ import annotations

import torch
import triton

from mha2mla.kernels.backend import interpreting, multiprocessor_count
from mha2mla.kernels.flash_mla_kernels import _flash_mla_bwd_dkv_kernel, _flash_mla_bwd_dq_kernel, _flash_mla_fwd_kernel
from mha2mla.kernels.tuning import (
    ConfigCache,
    FlashMLAConfig,
    autotune_enabled,
    combine,
    dkv_heads_per_program,
    flash_candidates,
    flash_shape_key,
    next_power_of_two,
)

LOG2_E = 1.4426950408889634

__all__ = ["FlashMLAConfig", "FlashMLAFunction", "flash_mla_triton", "segment_bounds"]


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


def _heads_per_program(config: FlashMLAConfig, batch: int, heads: int, k_len: int, d_rope: int, device) -> int:
    if config.heads_per_program is not None:
        return max(1, min(heads, config.heads_per_program))
    return dkv_heads_per_program(heads, batch, k_len, d_rope, multiprocessor_count(device))


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
    common = {"UPCAST": interpreting(), "PRECISION": _precision(q.dtype), "num_warps": config.bwd_num_warps,
              "num_stages": config.bwd_num_stages}

    key_blocks = triton.cdiv(k_len, config.bwd_block_n)
    per_program = _heads_per_program(config, batch, heads, k_len, d_rope, q.device)
    groups = triton.cdiv(heads, per_program)
    dk_pe_parts = torch.empty(groups, batch, k_len, d_rope, device=q.device, dtype=torch.float32)  # per head group
    _flash_mla_bwd_dkv_kernel[(key_blocks, batch, groups)](
        q_nope, q_pe, k_nope, k_pe, v, dout, lse, delta,
        q_seg if has_segments else dummy, k_seg if has_segments else dummy, last_query if has_segments else dummy,
        dk_nope, dk_pe_parts, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k_nope.stride(0), k_nope.stride(1), k_nope.stride(2),
        k_pe.stride(0), k_pe.stride(1),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk_nope.stride(0), dk_nope.stride(1), dk_nope.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        heads, per_program, q_len, k_len, d_nope, d_rope, d_v, scale * LOG2_E, scale,
        CAUSAL=causal, HAS_SEGMENTS=has_segments, ONE_HEAD=per_program == 1,
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
    dk_pe = dk_pe_parts[0] if groups == 1 else dk_pe_parts.sum(0)  # (B, Tk, d_r): the groups' partials added
    return dq, dk_nope, dk_pe.to(k_pe.dtype), dv


_TUNED = ConfigCache()  # per process: the fastest candidate per (pass, shape key), timed on first use


def _time_ms(launch) -> float:
    from triton.testing import do_bench

    return float(do_bench(launch, warmup=5, rep=20))


def _shape_key(pass_name, q, k_nope, k_pe, v, causal, segments) -> tuple:
    batch, heads, q_len, _ = q.shape
    return flash_shape_key(pass_name, batch, heads, q_len, k_nope.shape[2], k_nope.shape[3], k_pe.shape[2],
                           v.shape[3], str(q.dtype), causal, segments[0] is not None)


def _forward_config(q, k_nope, k_pe, v, scale, causal, segments) -> FlashMLAConfig:
    """The table's config, or on CUDA the fastest forward candidate for this shape (timed once, cached)."""
    candidates = flash_candidates(k_nope.shape[3], k_pe.shape[2], v.shape[3], interpreting())
    if not autotune_enabled(interpreting()):
        return candidates[0]
    key = _shape_key("forward", q, k_nope, k_pe, v, causal, segments)
    return _TUNED.pick(key, candidates,
                       lambda c: _time_ms(lambda: _forward(q, k_nope, k_pe, v, scale, causal, segments, c)))


def _backward_config(forward_config, dout, saved, scale, causal, segments) -> FlashMLAConfig:
    """``forward_config`` with the table's backward settings, or the fastest backward candidate on CUDA."""
    q, k_nope, k_pe, v, _, _ = saved
    candidates = [combine(forward_config, c) for c in flash_candidates(k_nope.shape[3], k_pe.shape[2], v.shape[3],
                                                                         interpreting())]
    if not autotune_enabled(interpreting()):
        return candidates[0]
    key = _shape_key("backward", q, k_nope, k_pe, v, causal, segments)
    return _TUNED.pick(key, candidates,
                       lambda c: _time_ms(lambda: _backward(dout, *saved, scale, causal, segments, c)))


class FlashMLAFunction(torch.autograd.Function):
    """out = softmax(scale * (q_nope k_nope^T + q_pe k_pe^T) + mask) v, with k_pe shared by all heads.
    ``config`` None: chosen per shape (:mod:`mha2mla.kernels.tuning`), separately for forward and backward."""

    @staticmethod
    def forward(ctx, q, k_nope, k_pe, v, scale, causal, q_seg, k_seg, first_key, last_query, config):
        segments = (q_seg, k_seg, first_key, last_query)
        chosen = config or _forward_config(q, k_nope, k_pe, v, scale, causal, segments)
        out, lse = _forward(q, k_nope, k_pe, v, scale, causal, segments, chosen)
        ctx.save_for_backward(q, k_nope, k_pe, v, out, lse, q_seg, k_seg, first_key, last_query)
        ctx.scale, ctx.causal, ctx.config, ctx.tune_backward = scale, causal, chosen, config is None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_nope, k_pe, v, out, lse, q_seg, k_seg, first_key, last_query = ctx.saved_tensors
        segments = (q_seg, k_seg, first_key, last_query)
        saved = (q, k_nope, k_pe, v, out, lse)
        config = ctx.config
        if ctx.tune_backward:
            config = _backward_config(config, _last_dim_contiguous(dout), saved, ctx.scale, ctx.causal, segments)
        dq, dk_nope, dk_pe, dv = _backward(dout, *saved, ctx.scale, ctx.causal, segments, config)
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
    v (B, H, Tk, d_v) -> (B, H, Tq, d_v). Any strides with a unit last stride (views are not copied).
    ``config`` None: tiles and warps chosen per shape (:mod:`mha2mla.kernels.tuning`)."""
    batch, heads, q_len, d_qk = q.shape
    k_len = k_nope.shape[2]
    assert k_nope.shape[:2] == (batch, heads) and v.shape[:3] == (batch, heads, k_len), (q.shape, k_nope.shape, v.shape)
    assert k_pe.shape[:2] == (batch, k_len) and d_qk == k_nope.shape[3] + k_pe.shape[2], (q.shape, k_nope.shape, k_pe.shape)
    assert q_len <= k_len, "queries must be the last Tq of the Tk key positions"
    assert q.dtype == k_nope.dtype == k_pe.dtype == v.dtype, "one dtype (ops.flash_mla_attention resolves mixed ones)"
    q, k_nope, k_pe, v = (_last_dim_contiguous(t) for t in (q, k_nope, k_pe, v))
    q_seg = k_seg = first_key = last_query = None
    if segment_ids is not None:
        k_seg = segment_ids.to(device=q.device, dtype=torch.int32).expand(batch, k_len).contiguous()  # (B, Tk)
        q_seg = (k_seg[:, k_len - q_len :] if q_segment_ids is None else q_segment_ids.to(q.device, torch.int32))
        q_seg = q_seg.expand(batch, q_len).contiguous()  # (B, Tq)
        first_key, last_query = segment_bounds(q_seg, k_seg)
    return FlashMLAFunction.apply(q, k_nope, k_pe, v, float(softmax_scale), bool(causal), q_seg, k_seg, first_key, last_query, config)
