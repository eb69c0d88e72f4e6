"""The MLA latent cache: ``r + d_r`` values per token per layer, nothing per head.

One preallocated tensor ``[L, B, T_max, r + d_r]`` holds, for every layer, batch row and position, the
*normalised* latent ``c`` (after ``kv_a_layernorm``, ``r`` values) followed by the *rotated* rope key
``k_pe`` (``d_r`` values) — exactly what transformers' DeepseekV3 caches, laid out side by side so
that one matmul scores a query against both. Sequences are ragged: row ``b`` holds ``lengths[b]`` valid
positions starting at 0 (no left padding, so every sequence keeps its own positions 0, 1, 2, ...).

Attention over it is ``mha2mla.kernels.ops.latent_cache_decode`` (docs/generate.md, docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LatentCache:
    data: torch.Tensor  # (L, B, T_max, r + d_r)
    lengths: torch.Tensor  # (B,) int64, valid positions per row
    kv_lora_rank: int  # r
    max_length: int = 0  # host copy of lengths.max(): no device sync per layer on a GPU

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch_size: int,
        max_tokens: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> LatentCache:
        data = torch.zeros(num_layers, batch_size, max_tokens, kv_lora_rank + rope_dim, dtype=dtype, device=device)
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(data=data, lengths=lengths, kv_lora_rank=kv_lora_rank)

    # the sizes, read off the preallocated tensor
    num_layers = property(lambda self: self.data.shape[0])  # L
    batch_size = property(lambda self: self.data.shape[1])  # B
    max_tokens = property(lambda self: self.data.shape[2])  # T_max

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (the whole preallocated tensor)."""
        return self.data.numel() * self.data.element_size()

    def layer(self, layer: int) -> torch.Tensor:
        return self.data[layer]  # (B, T_max, r + d_r)

    def set_lengths(self, lengths: list[int]) -> None:
        self.lengths.copy_(torch.as_tensor(lengths, dtype=torch.long))
        self.max_length = max(lengths)

    def advance(self) -> None:
        """Every row gained one token (after a decode step has written all layers)."""
        self.lengths += 1
        self.max_length += 1

    def write_prefill(self, layer: int, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Store a right-padded prefill chunk at positions ``0..T-1`` of every row.

        latent (B, T, r) normalised, rope_key (B, T, d_r) rotated. Positions past a row's length hold padding
        that decode never reads and later overwrites.
        """
        tokens = latent.shape[1]
        if tokens > self.max_tokens:
            raise ValueError(f"prefill of {tokens} tokens does not fit a cache of {self.max_tokens}")
        rank = self.kv_lora_rank
        self.data[layer, :, :tokens, :rank] = latent
        self.data[layer, :, :tokens, rank:] = rope_key

    def write_step(self, layer: int, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Store one new token per row at position ``lengths[b]``. latent (B, r), rope_key (B, d_r)."""
        if self.max_length >= self.max_tokens:
            raise ValueError(f"the latent cache is full ({self.max_tokens} tokens)")
        rows = torch.arange(self.batch_size, device=self.data.device)
        self.data[layer, rows, self.lengths] = torch.cat([latent, rope_key], dim=-1).to(self.data.dtype)

    def repeat_rows(self, times: int) -> LatentCache:
        """A cache of ``B * times`` rows, each row repeated ``times`` times (benchmarks use it to skip prefills)."""
        return LatentCache(
            data=self.data.repeat_interleave(times, dim=1),
            lengths=self.lengths.repeat_interleave(times),
            kv_lora_rank=self.kv_lora_rank,
            max_length=self.max_length,
        )

