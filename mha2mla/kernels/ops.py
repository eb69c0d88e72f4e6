"""Public entry points. Each runs Triton or the PyTorch reference as ``mha2mla.kernels.backend`` decides
(docs/kernels.md): ``backend=None`` asks ``choose_backend`` about the tensors; the latent-cache model passes the
answer ``decode_attention_backend`` gave it once. Triton modules are imported on first use only, so that this
module imports without Triton (CPU installs) and compiles nothing until a kernel runs."""

from __future__ import annotations

import functools

import torch

from mha2mla.kernels import reference
from mha2mla.kernels.backend import choose_backend


def attention_compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The one dtype MLA attention computes in (its tiles; scores, softmax and sums stay float32 inside).

    Under ``torch.autocast`` for the tensors' device it is the autocast dtype, as for a matmul: transformers
    builds q, k_nope, k_pe and v from projections (autocast's dtype) and rotary products (float32), so under
    autocast they arrive in mixed dtypes. Outside autocast mixed inputs are promoted (torch.promote_types), so
    the result is exact for the widest input."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def flash_mla_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    segment_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """MLA attention for training and prefill, differentiable.

    q (B, H, Tq, d_n + d_r), k_nope (B, H, Tk, d_n), k_pe (B, Tk, d_r) shared by all heads (a
    (B, 1, Tk, d_r) tensor is accepted too), v (B, H, Tk, d_v) -> (B, H, Tq, d_v).
    Packed sequences: ``segment_ids`` (B, Tk) int, or ``cu_seqlens`` (N+1,) with B == 1.
    The inputs are cast to :func:`attention_compute_dtype` (the output's dtype); gradients flow back to each
    input in its own dtype."""
    dtype = attention_compute_dtype(q, k_nope, k_pe, v)
    q, k_nope, k_pe, v = (t.to(dtype) for t in (q, k_nope, k_pe, v))  # no-ops when already in dtype
    if k_pe.dim() == 4:
        assert k_pe.shape[1] == 1, f"k_pe must be shared by all heads, got {tuple(k_pe.shape)}"
        k_pe = k_pe[:, 0]  # (B, Tk, d_r)
    if cu_seqlens is not None:
        assert segment_ids is None and q.shape[0] == 1, "cu_seqlens describes one packed row (B == 1)"
        segment_ids = reference.segment_ids_from_cu_seqlens(cu_seqlens, k_nope.shape[2])  # (1, Tk)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    backend = backend or choose_backend(q, k_nope, k_pe, v)
    if backend == "triton":
        from mha2mla.kernels.flash_mla import flash_mla_triton

        return flash_mla_triton(q, k_nope, k_pe, v, scale, causal, segment_ids)
    return reference.flash_mla_reference(q, k_nope, k_pe, v, scale, causal, segment_ids)


def mla_decode_latent(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the latent cache for absorbed queries: q_lat (B, H, r), q_pe (B, H, d_r),
    latent (B, T, r), k_pe (B, T, d_r), cache_seqlens (B,) -> o_lat (B, H, r) fp32, lse (B, H) fp32."""
    backend = backend or choose_backend(q_lat, latent)
    if backend == "triton":
        from mha2mla.kernels.decode import mla_decode_latent_triton

        return mla_decode_latent_triton(q_lat, q_pe, latent, k_pe, cache_seqlens, softmax_scale, num_splits)
    return reference.mla_decode_latent_reference(q_lat, q_pe, latent, k_pe, cache_seqlens, softmax_scale)


def latent_cache_decode(
    query: torch.Tensor,
    cache_layer: torch.Tensor,
    lengths: torch.Tensor,
    max_length: int,
    kv_lora_rank: int,
    softmax_scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """Absorbed decode attention of the latent-cache model (docs/generate.md), one new token per row.

    query (B, H, r + d_r) = ``[W_UK^T q_nope ; q_pe]``, cache_layer (B, T_max, r + d_r) one layer of the
    LatentCache, lengths (B,) valid rows (the new token included), max_length = max(lengths) as a host int ->
    o_lat (B, H, r) in query's dtype; W_UV is the caller's. "triton" runs the split-KV kernel over views of
    the cache rows, "reference" :func:`reference.latent_cache_decode_reference`."""
    backend = backend or choose_backend(query, cache_layer)
    if backend == "triton":
        latent, k_pe = reference.split_latent_cache(cache_layer[:, :max_length], kv_lora_rank)  # views (B, T, r), (B, T, d_r)
        out_latent, _ = mla_decode_latent(query[..., :kv_lora_rank], query[..., kv_lora_rank:], latent, k_pe, lengths,
                                          softmax_scale, backend="triton")  # (B, H, r) fp32
        return out_latent.to(query.dtype)
    return reference.latent_cache_decode_reference(query, cache_layer, lengths, max_length, kv_lora_rank, softmax_scale)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One decode step from the latent cache with absorbed weights (docs/kernels.md).

    q_nope (B, H, d_n), q_pe (B, H, d_r) rotated, latent_cache (B, T, r + d_r) = [normalised latent c,
    rotated k_pe] per token (only the first cache_seqlens[b] rows of sequence b are read),
    w_uk (H, d_n, r), w_uv (H, d_v, r) from ``absorbed.safetensors`` -> (B, H, d_v) in q_nope's dtype.
    Keys and values are never expanded per head: the query is absorbed into the latent space."""
    heads, _, rank = w_uk.shape
    assert latent_cache.shape[-1] == rank + q_pe.shape[-1], (latent_cache.shape, w_uk.shape, q_pe.shape)
    assert w_uv.shape[0] == heads and w_uv.shape[2] == rank, (w_uk.shape, w_uv.shape)
    latent, k_pe = reference.split_latent_cache(latent_cache, rank)  # views (B, T, r), (B, T, d_r)
    q_lat = reference.absorb_query(q_nope, w_uk).to(latent_cache.dtype)  # (B, H, r)
    o_lat, _ = mla_decode_latent(q_lat, q_pe.to(latent_cache.dtype), latent, k_pe, cache_seqlens, softmax_scale,
                                 num_splits, backend)
    out = torch.einsum("bhr,hvr->bhv", o_lat, w_uv.float())  # (B, H, d_v)
    return out.to(q_nope.dtype)
