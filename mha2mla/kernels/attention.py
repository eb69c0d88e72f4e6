"""``attn_implementation="mha2mla_triton"``: MLA attention through our kernel inside transformers.

transformers' DeepseekV3Attention expands the cached latent into key_states (B, H, Tk, d_n + d_r) and
value_states (B, H, Tk, d_v) before calling the attention interface; the last d_r channels of the key are
the ONE rope key copied into every head. We pass the kernel the no-rope part as a strided view and the
rope part of head 0 as the shared k_pe (B, Tk, d_r): no further per-head copy is made, and the kernel
sums the rope-key gradient over heads. Autograd then routes that sum through head 0's slice of
key_states back to transformers' expand of k_rot, which is exactly the gradient of the shared key.

Masks: we register transformers' ``flash_attention_mask`` for our name, so we receive either None
(plain causal) or the 2D padding mask (B, Tk). Padding and packed sequences (``position_ids`` that
restart, or ``cu_seq_lens_k``) become segment ids. A 4D mask (custom masks) or GQA key heads fall back
to transformers' SDPA attention with a one-time warning.
"""

from __future__ import annotations

import logging
import weakref

import torch

from mha2mla.kernels.ops import flash_mla_attention
from mha2mla.kernels.reference import segment_ids_from_cu_seqlens, segment_ids_from_position_ids

ATTENTION_NAME = "mha2mla_triton"
logger = logging.getLogger(__name__)
_warned: set[str] = set()
_segment_memo: dict = {"key": None, "refs": None, "segments": None}


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _same_tensors(refs, tensors) -> bool:
    """True when every memoised weak reference still points at the very same tensor object."""
    return refs is not None and all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors))


def attention_segment_ids(
    batch: int, q_len: int, k_len: int, attention_mask=None, position_ids=None, cu_seq_lens_k=None
) -> torch.Tensor | None:
    """Segment ids (B, Tk) for the kernel, or None when plain causal attention is exact.

    Padding keys (mask 0) get segment -1; packed sequences get one id each. All layers of one forward
    see the same mask / position tensors, so the result is memoised on those tensor objects (weak
    references plus their version counters) and the host sync happens once per forward."""
    tensors = (attention_mask, position_ids, cu_seq_lens_k)
    key = (batch, q_len, k_len, tuple(None if t is None else t._version for t in tensors))
    if _segment_memo["key"] == key and _same_tensors(_segment_memo["refs"], tensors):
        return _segment_memo["segments"]
    segments = None
    if cu_seq_lens_k is not None and batch == 1 and q_len == k_len:
        segments = segment_ids_from_cu_seqlens(cu_seq_lens_k, k_len)  # (1, Tk)
    elif position_ids is not None and q_len == k_len and position_ids.shape[-1] == k_len:
        candidate = segment_ids_from_position_ids(position_ids.expand(batch, k_len))  # (B, Tk)
        if bool((candidate[:, -1] > 0).any()):  # some row holds more than one sequence
            segments = candidate
    if attention_mask is not None:
        keep = attention_mask[:, -k_len:].to(torch.bool)  # (B, Tk)
        base = segments if segments is not None else torch.zeros_like(keep, dtype=torch.int32)
        segments = torch.where(keep, base, torch.full_like(base, -1))
    _segment_memo.update(key=key, refs=tuple(None if t is None else weakref.ref(t) for t in tensors), segments=segments)
    return segments


def mha2mla_triton_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: query (B, H, Tq, d_n + d_r), key (B, H, Tk, d_n + d_r),
    value (B, H, Tk, d_v) -> (B, Tq, H, d_v), None."""
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} has no attention dropout; set config.attention_dropout = 0.0.")
    batch, heads, q_len, qk_dim = query.shape
    k_len = key.shape[2]
    is_4d_mask = attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2)
    if is_4d_mask or key.shape[1] != heads:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        why = "a 4D attention mask" if is_4d_mask else "fewer key heads than query heads"
        _warn_once(why, f"{ATTENTION_NAME}: {why} is not supported by the Triton MLA kernel; using SDPA instead.")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)

    d_nope = getattr(module, "qk_nope_head_dim", qk_dim)
    rope_all_heads = key[..., d_nope:]  # (B, H, Tk, d_r)
    shared = rope_all_heads.stride(1) == 0 or getattr(module, "kv_lora_rank", None) is not None
    if not shared:  # a generic module: no shared rope key, everything is "no-rope"
        d_nope = qk_dim
    k_nope = key[..., :d_nope]  # (B, H, Tk, d_n) strided view
    k_pe = key[:, 0, :, d_nope:]  # (B, Tk, d_r) head 0's copy of the shared rope key (view)

    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    segments = attention_segment_ids(
        batch, q_len, k_len, attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_k")
    )
    out = flash_mla_attention(query, k_nope, k_pe, value, scaling, causal=causal, segment_ids=segments)  # (B, H, Tq, d_v)
    return out.transpose(1, 2), None  # (B, Tq, H, d_v)


def register_attention() -> str:
    """Register ``mha2mla_triton`` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION_NAME, mha2mla_triton_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)
    return ATTENTION_NAME
