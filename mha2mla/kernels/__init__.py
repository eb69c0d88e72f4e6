"""MLA kernels (docs/kernels.md): Triton flash attention for training/prefill, absorbed split-KV decode over
the latent cache, their PyTorch references, and the ``mha2mla_triton`` transformers attention.

Importing this package registers ``attn_implementation="mha2mla_triton"`` with transformers. Triton
modules are imported lazily, on first use on a CUDA tensor (or under ``TRITON_INTERPRET=1``).
"""

from mha2mla.kernels.attention import ATTENTION_NAME, mha2mla_triton_attention, register_attention
from mha2mla.kernels.backend import DECODE_ATTENTION, choose_backend, decode_attention_backend
from mha2mla.kernels.ops import flash_mla_attention, latent_cache_decode, mla_decode, mla_decode_latent
from mha2mla.kernels.reference import (
    flash_mla_reference,
    latent_cache_decode_reference,
    mla_decode_reference,
    mla_decode_unabsorbed_reference,
    segment_ids_from_cu_seqlens,
    segment_ids_from_position_ids,
)

register_attention()

__all__ = [
    "ATTENTION_NAME",
    "DECODE_ATTENTION",
    "choose_backend",
    "decode_attention_backend",
    "flash_mla_attention",
    "flash_mla_reference",
    "latent_cache_decode",
    "latent_cache_decode_reference",
    "mha2mla_triton_attention",
    "mla_decode",
    "mla_decode_latent",
    "mla_decode_reference",
    "mla_decode_unabsorbed_reference",
    "register_attention",
    "segment_ids_from_cu_seqlens",
    "segment_ids_from_position_ids",
]
