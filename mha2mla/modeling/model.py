"""The latent-cache MLA model: weights and forward passes of a converted DeepSeek-V3 checkpoint (docs/generate.md).

The model computes DeepSeek-V3 itself from the checkpoint's tensors (read by
:func:`mha2mla.io.mla_checkpoint.read_mla_checkpoint`, the other tensors lazily by
:class:`mha2mla.io.reader.LazyCheckpoint`):

- **prefill** (the prompt) runs un-absorbed: the latent is expanded through ``kv_b_proj`` into per-head keys and
  values once, and attention is causal SDPA; the normalised latent ``c`` and the rotated rope key ``k_pe`` are
  written to the :class:`~mha2mla.modeling.latent_cache.LatentCache`;
- **decode** (one token per row and step) runs absorbed: ``q_lat = W_UK^T q_nope`` per head, scores against the
  cached ``[c ; k_pe]``, ``o_lat = sum p c``, then ``W_UV`` and ``o_proj``. Keys and values are never expanded
  per head, so a step reads only ``r + d_r`` values per cached token per layer. Which implementation computes
  that attention (the Triton split-KV kernel or PyTorch) is decided once by
  :func:`mha2mla.kernels.backend.decode_attention_backend`.

Logits equal transformers' ``DeepseekV3ForCausalLM`` on the same checkpoint (tests/modeling/test_generate.py). The
generation loop, sampling and detokenisation live in :mod:`mha2mla.modeling.generate`.

Dtypes: the weights, the matmuls, the attention and the latent cache are in the model's ``dtype`` (the compute
dtype, float32 or bfloat16); the residual stream (embedding, the adds of every attention and MLP output, the
norms that read it) stays float32 in every dtype, and each matmul reads its input cast to the weights' dtype. In
bf16 that costs a cast of a few rows per matmul in decode and spares the stream a bf16 rounding at every add,
which transformers' bf16 model takes (and which moves logits most); logits are returned float32. In float32
nothing changes.

    model = MLAModel.from_pretrained("out/smollm2-mla", device="cpu")
    cache = model.new_cache(batch_size=1, max_tokens=64)
    logits = model.prefill(cache, [[1, 2, 3]])
    logits = model.decode(cache, logits.argmax(-1))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from mha2mla import UserError
from mha2mla.compute import resolve_compute_dtype, torch_dtype
from mha2mla.io.mla_checkpoint import read_mla_checkpoint
from mha2mla.kernels.backend import decode_attention_backend
from mha2mla.kernels.ops import latent_cache_decode
from mha2mla.modeling.absorbed import softmax_scale
from mha2mla.modeling.latent_cache import LatentCache
from mha2mla.modeling.linear import linear, pack, pack_layer, packing_applies
from mha2mla.modeling.rmsnorm import rms_norm
from mha2mla.modeling.weights import LayerWeights, check_absorbed_index, check_config, load_layer

LATENT_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm / q_a_layernorm with its default eps, not rms_norm_eps


# ----------------------------------------------------------------------------------------------------------
# rope


class Rope:
    """Rotary frequencies exactly as transformers' DeepseekV3RotaryEmbedding computes them (rope scaling
    included: the same ROPE_INIT_FUNCTIONS give inv_freq and the attention scaling; longrope switches to its
    long factors when a forward pass reaches past original_max_position_embeddings, as transformers does)."""

    def __init__(self, config, device):
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        if self.rope_type == "default":
            inv_freq, scaling = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, None)
        self.inv_freq = inv_freq.float().to(device)  # (d_r/2,)
        self.attention_scaling = float(scaling)
        self.long_inv_freq = None
        if self.rope_type == "longrope":
            original = config.rope_parameters["original_max_position_embeddings"]
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1)
            self.long_inv_freq = long_inv_freq.float().to(device)
            self.original_max_positions = original
        self.interleaved = bool(config.rope_interleave)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...) -> cos, sin (..., d_r/2): one angle per rotation pair."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and int(positions.max()) + 1 > self.original_max_positions:
            inv_freq = self.long_inv_freq
        angles = positions[..., None].float() * inv_freq  # (..., d_r/2)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x (..., d_r) with cos/sin broadcastable to (..., d_r/2). Output in half-split layout for the
        interleaved case, like transformers (q and k share it, so their dot products are unchanged)."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ----------------------------------------------------------------------------------------------------------
# the model


class MLAModel:
    """Weights of a converted dense DeepSeek-V3 checkpoint and its prefill / absorbed-decode forward passes."""

    def __init__(self, config, embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, device: torch.device, dtype: torch.dtype, decode_attention: str = "auto"):
        self.config = config
        self.embed = embed  # (V, D)
        self.layers = layers
        self.final_norm = final_norm  # (D,)
        self.lm_head = lm_head  # (V, D), the embedding itself when tied
        self.device = device
        self.dtype = dtype
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_dim = config.qk_rope_head_dim
        self.nope_dim = config.qk_nope_head_dim
        self.v_dim = config.v_head_dim
        self.scale = softmax_scale(config)
        self.rope = Rope(config, device)
        self.act = ACT2FN[config.hidden_act]
        self.decode_backend = decode_attention_backend(device, decode_attention)  # "triton" or "reference"

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, decode_attention: str = "auto") -> MLAModel:
        """Load the weights of a converted checkpoint folder (config, safetensors, absorbed weights), read through
        :func:`mha2mla.io.mla_checkpoint.read_mla_checkpoint` and checked here against what the model computes.

        dtype is the weights, activations and cache dtype: a torch dtype, or a compute dtype name (auto, float32,
        bfloat16; None is auto) resolved by :func:`mha2mla.compute.resolve_compute_dtype` for the device. bf16
        weights on CPU are packed for oneDNN once here (:mod:`mha2mla.modeling.linear`). decode_attention:
        "torch" (plain PyTorch), "kernel" (mha2mla.kernels' split-KV decode), or "auto" (the kernel on CUDA,
        PyTorch on CPU); see :func:`mha2mla.kernels.backend.decode_attention_backend`."""
        device = torch.device(device)
        if dtype is None or isinstance(dtype, str):
            dtype = torch_dtype(resolve_compute_dtype(dtype, str(device)))
        checkpoint = read_mla_checkpoint(folder, check_config=check_config)
        config, absorbed, reader = checkpoint.config, checkpoint.absorbed, checkpoint.reader
        check_absorbed_index(checkpoint.absorbed_index, config)

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        layers = [load_layer(reader, absorbed, config, i, put) for i in range(config.num_hidden_layers)]
        D, V = config.hidden_size, config.vocab_size
        embed = put(reader.get("model.embed_tokens.weight", dtype=None, shape=(V, D)))
        lm_head = embed
        if "lm_head.weight" in reader and not config.tie_word_embeddings:
            lm_head = put(reader.get("lm_head.weight", dtype=None, shape=(V, D)))
        final_norm = put(reader.get("model.norm.weight", dtype=None, shape=(D,)))
        if packing_applies(device, dtype):  # the embedding stays plain for lookups; a tied lm_head is a packed copy
            layers, lm_head = [pack_layer(w) for w in layers], pack(lm_head)
        return cls(config, embed, layers, final_norm, lm_head, device, dtype, decode_attention)

    def new_cache(self, batch_size: int, max_tokens: int) -> LatentCache:
        return LatentCache.allocate(self.config.num_hidden_layers, batch_size, max_tokens, self.kv_lora_rank,
                                    self.rope_dim, self.dtype, self.device)

    # -- pieces of a layer ----------------------------------------------------------------------------------

    def _query(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> q (..., H*(d_n+d_r))."""
        if w.q_proj is not None:
            return linear(x, w.q_proj)
        q_latent = rms_norm(linear(x, w.q_a_proj, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS)
        return linear(q_latent, w.q_b_proj)

    def _latent(self, w: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., D) -> normalised latent c (..., r), un-rotated rope key (..., d_r)."""
        compressed = linear(x, w.kv_a_proj, w.kv_a_bias)  # (..., r + d_r)
        latent, rope_key = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS), rope_key

    def _mlp_block(self, w: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer's post-attention norm and dense MLP."""
        x = rms_norm(hidden, w.post_attention_norm, self.config.rms_norm_eps)
        return hidden + linear(self.act(linear(x, w.gate_proj)) * linear(x, w.up_proj), w.down_proj)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head).float()

    # -- forward passes --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, cache: LatentCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run the prompts (one per cache row, ragged) through the un-absorbed path, fill the cache, and
        return the logits at each prompt's last token, (B, V) fp32."""
        if len(prompts) != cache.batch_size:
            raise ValueError(f"{len(prompts)} prompts for a cache of {cache.batch_size} rows")
        prompt_lengths = [len(p) for p in prompts]
        if min(prompt_lengths) < 1:
            raise UserError("every prompt needs at least one token.")
        lengths = torch.tensor(prompt_lengths, dtype=torch.long, device=self.device)
        B, T = len(prompts), max(prompt_lengths)
        H, d_n, d_r, d_v = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        ids = torch.zeros(B, T, dtype=torch.long, device=self.device)  # right padding; causal attention keeps
        for row, prompt in enumerate(prompts):  # padding out of every real token's view
            ids[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        cos, sin = self.rope.cos_sin(torch.arange(T, device=self.device), self.dtype)  # (T, d_r/2)
        hidden = F.embedding(ids, self.embed).float()  # (B, T, D) the residual stream: float32 in every dtype
        for index, w in enumerate(self.layers):
            x = rms_norm(hidden, w.input_norm, self.config.rms_norm_eps)
            q = self._query(w, x).view(B, T, H, d_n + d_r).transpose(1, 2)  # (B, H, T, d_n+d_r)
            q_nope, q_pe = q.split([d_n, d_r], dim=-1)
            latent, rope_key = self._latent(w, x)  # (B, T, r), (B, T, d_r)
            q_pe = self.rope.apply(q_pe, cos, sin)
            rope_key = self.rope.apply(rope_key, cos, sin)
            cache.write_prefill(index, latent, rope_key)
            kv = linear(latent, w.kv_b_proj).view(B, T, H, d_n + d_v).transpose(1, 2)  # (B, H, T, d_n+d_v)
            k_nope, value = kv.split([d_n, d_v], dim=-1)
            key = torch.cat([k_nope, rope_key[:, None].expand(B, H, T, d_r)], dim=-1)  # (B, H, T, d_n+d_r)
            attn = causal_attention(torch.cat([q_nope, q_pe], dim=-1), key, value, self.scale)  # (B, H, T, d_v)
            hidden = hidden + linear(attn.transpose(1, 2).reshape(B, T, H * d_v), w.o_proj, w.o_bias)
            hidden = self._mlp_block(w, hidden)
        cache.set_lengths(prompt_lengths)
        last = hidden[torch.arange(B, device=self.device), lengths - 1]  # (B, D)
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, cache: LatentCache, tokens: torch.Tensor) -> torch.Tensor:
        """One absorbed decode step: tokens (B,) at positions cache.lengths -> logits (B, V) fp32."""
        B = cache.batch_size
        H, d_n, d_r, d_v, r = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank
        positions = cache.lengths  # (B,) position of the new token in each row
        lengths_after, max_after = positions + 1, cache.max_length + 1
        cos, sin = self.rope.cos_sin(positions, self.dtype)  # (B, d_r/2)
        hidden = F.embedding(tokens.to(self.device), self.embed).float()  # (B, D) float32 residual stream
        for index, w in enumerate(self.layers):
            x = rms_norm(hidden, w.input_norm, self.config.rms_norm_eps)
            q = self._query(w, x).view(B, H, d_n + d_r)
            q_nope, q_pe = q.split([d_n, d_r], dim=-1)
            q_pe = self.rope.apply(q_pe, cos[:, None], sin[:, None])  # (B, H, d_r)
            latent, rope_key = self._latent(w, x)  # (B, r), (B, d_r)
            cache.write_step(index, latent, self.rope.apply(rope_key, cos, sin))
            q_latent = torch.matmul(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # (B, H, r) = W_UK^T q_nope
            query = torch.cat([q_latent, q_pe], dim=-1)  # (B, H, r + d_r)
            out_latent = latent_cache_decode(query, cache.layer(index), lengths_after, max_after, r, self.scale,
                                             backend=self.decode_backend)  # (B, H, r)
            out = torch.matmul(out_latent.transpose(0, 1), w.w_uv_t).transpose(0, 1)  # (B, H, d_v)
            hidden = hidden + linear(out.reshape(B, H * d_v), w.o_proj, w.o_bias)
            hidden = self._mlp_block(w, hidden)
        cache.advance()
        return self._logits(hidden)


# ----------------------------------------------------------------------------------------------------------
# helpers


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA where value's head dim may differ from query/key's. PyTorch's fused kernels need equal
    head dims (otherwise the math path materialises T x T scores), so the smaller side is zero-padded:
    zero value channels give zero outputs, zero query/key channels add nothing to the scores."""
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim < qk_dim:
        out = F.scaled_dot_product_attention(query, key, F.pad(value, (0, qk_dim - v_dim)), is_causal=True, scale=scale)
        return out[..., :v_dim]
    if qk_dim < v_dim:
        pad = (0, v_dim - qk_dim)
        return F.scaled_dot_product_attention(F.pad(query, pad), F.pad(key, pad), value, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)


def cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes the latent cache holds per token, all layers: (r + d_r) * layers * element size."""
    element = torch.empty((), dtype=dtype).element_size()
    return (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * element


__all__ = ["LATENT_NORM_EPS", "LayerWeights", "MLAModel", "Rope", "cache_bytes_per_token", "causal_attention",
           "check_config"]
