"""Plain-PyTorch references for the MLA kernels: the ground truth in tests and the CPU fallback.

Shapes (B batch, H heads, Tq/Tk query/key tokens, d_n no-rope head dim, d_r rope dim, d_v value dim,
r latent rank):

    q        (B, H, Tq, d_n + d_r)   query: no-rope part first, rope part last (transformers' layout)
    k_nope   (B, H, Tk, d_n)         per-head no-rope key (kv_b_proj output)
    k_pe     (B, Tk, d_r)            ONE rotated rope key per token, shared by all heads
    v        (B, H, Tk, d_v)
    out      (B, H, Tq, d_v)

Masking: causal with the query block aligned to the end of the keys (query i sits at key position
``i + Tk - Tq``, as with a cache), and optionally segment ids (packed sequences / padding): query i may
attend key j only when ``q_segment[i] == k_segment[j]``. A query row with no visible key outputs zeros.
"""

from __future__ import annotations

import torch


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int | None = None) -> torch.Tensor:
    """``cu_seqlens`` [N+1] (0, len0, len0+len1, ...) -> segment ids [1, total] (int32)."""
    cu_seqlens = cu_seqlens.to(torch.long)
    total = int(cu_seqlens[-1]) if total_tokens is None else total_tokens
    positions = torch.arange(total, device=cu_seqlens.device)  # (T,)
    segments = torch.searchsorted(cu_seqlens[1:], positions, right=True)  # (T,) index of the sequence
    return segments.to(torch.int32).unsqueeze(0)  # (1, T)


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids`` [B, T]: a new segment starts wherever the position does not follow on by one
    (the rule transformers uses to detect packed sequences). Returns int32 [B, T]."""
    position_ids = position_ids.to(torch.long)
    starts = torch.ones_like(position_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return (torch.cumsum(starts.to(torch.int32), dim=1) - 1).to(torch.int32)  # (B, T)


def attention_mask_reference(
    q_len: int,
    k_len: int,
    causal: bool = True,
    q_segment_ids: torch.Tensor | None = None,
    k_segment_ids: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """Boolean visibility [B or 1, 1, Tq, Tk] (True = attend)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)  # (Tq, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, Tk)
    visible = (k_pos <= q_pos) if causal else torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    visible = visible[None, None]  # (1, 1, Tq, Tk)
    if k_segment_ids is not None:
        if q_segment_ids is None:
            q_segment_ids = k_segment_ids[:, k_len - q_len :]
        same = q_segment_ids[:, :, None] == k_segment_ids[:, None, :]  # (B, Tq, Tk)
        visible = visible & same[:, None]  # (B, 1, Tq, Tk)
    return visible


def flash_mla_reference(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    segment_ids: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference MLA attention with a shared rope key. Computes in fp32, returns ``q.dtype``.

    ``segment_ids`` [B, Tk] are the key segments; query segments default to its last Tq entries."""
    q_len, qk_dim = q.shape[2], q.shape[3]
    d_nope = k_nope.shape[-1]
    k_len = k_nope.shape[2]
    assert qk_dim == d_nope + k_pe.shape[-1], (q.shape, k_nope.shape, k_pe.shape)
    scale = qk_dim**-0.5 if softmax_scale is None else softmax_scale
    q32, kn32, kp32, v32 = q.float(), k_nope.float(), k_pe.float(), v.float()
    scores = torch.einsum("bhqd,bhkd->bhqk", q32[..., :d_nope], kn32)  # (B, H, Tq, Tk)
    scores = scores + torch.einsum("bhqd,bkd->bhqk", q32[..., d_nope:], kp32)  # shared rope key
    scores = scores * scale
    visible = attention_mask_reference(q_len, k_len, causal, q_segment_ids, segment_ids, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> zeros
    out = torch.einsum("bhqk,bhkv->bhqv", probs, v32)  # (B, H, Tq, d_v)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------- decode


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat[b, h] = W_UK[h]^T q_nope[b, h]: (B, H, d_n) x (H, d_n, r) -> (B, H, r), fp32."""
    return torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk.float())


def split_latent_cache(latent_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., T, r + d_r) -> views c (..., T, r) and k_pe (..., T, d_r); no copy."""
    return latent_cache[..., :kv_lora_rank], latent_cache[..., kv_lora_rank:]


def mla_decode_latent_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode over the latent cache, one new query token per sequence.

    q_lat (B, H, r), q_pe (B, H, d_r), latent (B, T, r), k_pe (B, T, d_r), cache_seqlens (B,): the
    number of valid cache rows of each sequence. Returns o_lat (B, H, r) fp32 and the log-sum-exp
    (B, H) fp32 (natural log)."""
    max_len = latent.shape[1]
    scores = torch.einsum("bhr,btr->bht", q_lat.float(), latent.float())  # (B, H, T)
    scores = scores + torch.einsum("bhd,btd->bht", q_pe.float(), k_pe.float())
    scores = scores * softmax_scale
    valid = torch.arange(max_len, device=latent.device)[None, :] < cache_seqlens.to(latent.device)[:, None]  # (B, T)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # (B, H, T)
    o_lat = torch.einsum("bht,btr->bhr", probs, latent.float())  # (B, H, r)
    return o_lat, lse


def latent_cache_decode_reference(
    query: torch.Tensor, cache_layer: torch.Tensor, lengths: torch.Tensor, max_length: int, kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """The latent-cache model's absorbed decode attention in PyTorch, in the cache's own layout and dtype.

    query (B, H, r + d_r) = ``[W_UK^T q_nope ; q_pe]`` per head, cache_layer (B, T_max, r + d_r) = ``[c ; k_pe]``
    per token, lengths (B,) valid rows (the new token already written), max_length = max(lengths) ->
    o_lat (B, H, r) in query's dtype. Unlike :func:`mla_decode_latent_reference` (the fp32 ground truth of the
    kernel tests) the two matmuls run in the cache dtype, only the softmax in fp32: it is the fast fallback.

    In bf16/fp16 the scores are computed as ``keys @ query^T``: a reduced-precision bmm copies a transposed right
    operand first, which for ``query @ keys^T`` would be the whole cache slice on every layer of every step (the
    CPU's case); the same dot products either way. float32 keeps ``query @ keys^T``."""
    keys = cache_layer[:, :max_length]  # (B, T, r + d_r): one matmul scores against latent and rope key together
    invalid = torch.arange(max_length, device=query.device)[None, :] >= lengths[:, None]  # (B, T)
    if query.dtype != torch.float32:
        scores = torch.matmul(keys, query.transpose(1, 2)).transpose(1, 2)  # (B, H, T) view of (B, T, H)
        scores = scores.to(torch.float32, memory_format=torch.contiguous_format).mul_(scale)
        mask = torch.zeros(invalid.shape, dtype=torch.float32, device=query.device).masked_fill_(invalid, float("-inf"))
        probs = torch.softmax(scores.add_(mask[:, None, :]), dim=-1).to(query.dtype)  # (B, H, T)
        return torch.matmul(probs, keys[..., :kv_lora_rank])  # (B, H, r)
    scores = torch.matmul(query, keys.transpose(1, 2)).float() * scale  # (B, H, T)
    scores = scores.masked_fill(invalid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)  # (B, H, T)
    return torch.matmul(probs, keys[..., :kv_lora_rank])  # (B, H, r)


def mla_decode_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Absorbed decode in PyTorch: (B, H, d_n), (B, H, d_r), cache (B, T, r + d_r) -> (B, H, d_v)."""
    rank = w_uk.shape[-1]
    latent, k_pe = split_latent_cache(latent_cache, rank)
    q_lat = absorb_query(q_nope, w_uk)  # (B, H, r)
    o_lat, _ = mla_decode_latent_reference(q_lat, q_pe, latent, k_pe, cache_seqlens, softmax_scale)
    out = torch.einsum("bhr,hvr->bhv", o_lat, w_uv.float())  # (B, H, d_v)
    return out.to(q_nope.dtype)


def mla_decode_unabsorbed_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """The un-absorbed decode transformers does: expand every cached latent into per-head K and V,
    then ordinary attention. It builds (B, H, T, d_n) keys and (B, H, T, d_v) values; only a test oracle."""
    rank = w_uk.shape[-1]
    latent, k_pe = split_latent_cache(latent_cache.float(), rank)
    k_nope = torch.einsum("btr,hnr->bhtn", latent, w_uk.float())  # (B, H, T, d_n) per-head keys
    values = torch.einsum("btr,hvr->bhtv", latent, w_uv.float())  # (B, H, T, d_v) per-head values
    heads = q_nope.shape[1]
    keys = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1, -1)], dim=-1)  # (B, H, T, d_n + d_r)
    query = torch.cat([q_nope.float(), q_pe.float()], dim=-1)  # (B, H, d_n + d_r)
    scores = torch.einsum("bhd,bhtd->bht", query, keys) * softmax_scale  # (B, H, T)
    valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < cache_seqlens.to(keys.device)[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bht,bhtv->bhv", probs, values)  # (B, H, d_v)
    return out.to(q_nope.dtype)
