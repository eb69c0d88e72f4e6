"""Latent-cache generation for converted DeepSeek-V3 MLA checkpoints (DESIGN §4).

The engine computes the model itself from the checkpoint's tensors:

- **prefill** (the prompt) runs un-absorbed: the latent is expanded through ``kv_b_proj`` into per-head
  keys and values once, and attention is causal SDPA; the normalised latent ``c`` and the rotated rope
  key ``k_pe`` are written to the :class:`~mha2mla.modeling.latent_cache.LatentCache`;
- **decode** (one token per row and step) runs absorbed: ``q_lat = W_UK^T q_nope`` per head, scores
  against the cached ``[c ; k_pe]``, ``o_lat = sum p c``, then ``W_UV`` and ``o_proj``. Keys and values are
  never expanded per head, so a step reads only ``r + d_r`` values per cached token per layer.

Logits equal transformers' ``DeepseekV3ForCausalLM`` on the same checkpoint (tests/test_generate.py).

    engine = MLAEngine.from_pretrained("out/smollm2-mla", device="cpu")
    [result] = engine.generate(["The latent cache"], max_new_tokens=32, stream=lambda row, text: print(text, end=""))
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mha2mla import UserError
from mha2mla.modeling.absorbed import load_absorbed, softmax_scale, split_kv_b
from mha2mla.modeling.latent_cache import (
    LatentCache,
    absorbed_decode_attention_kernel,
    absorbed_decode_attention_torch,
)

ABSORBED_KERNEL_MODULE = "mha2mla.kernels.ops"  # mla_decode_latent: the split-KV absorbed decode (DESIGN §5)
DECODE_ATTENTION = ("auto", "torch", "kernel")
LATENT_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm / q_a_layernorm with its default eps, not rms_norm_eps

StreamCallback = Callable[[int, str], None]  # (row, new text)


# ----------------------------------------------------------------------------------------------------------
# weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (D,)
    post_attention_norm: torch.Tensor  # (D,)
    q_proj: torch.Tensor | None  # (H*(d_n+d_r), D) when q_lora_rank is None
    q_a_proj: torch.Tensor | None  # (q_r, D)
    q_a_bias: torch.Tensor | None  # (q_r,)
    q_a_norm: torch.Tensor | None  # (q_r,)
    q_b_proj: torch.Tensor | None  # (H*(d_n+d_r), q_r)
    kv_a_proj: torch.Tensor  # (r + d_r, D)
    kv_a_bias: torch.Tensor | None  # (r + d_r,)
    kv_a_norm: torch.Tensor  # (r,)
    kv_b_proj: torch.Tensor  # (H*(d_n+d_v), r), prefill only
    w_uk: torch.Tensor  # (H, d_n, r)
    w_uv_t: torch.Tensor  # (H, r, d_v)  W_UV transposed for a batched matmul
    o_proj: torch.Tensor  # (D, H*d_v)
    o_bias: torch.Tensor | None  # (D,)
    gate_proj: torch.Tensor  # (I, D)
    up_proj: torch.Tensor  # (I, D)
    down_proj: torch.Tensor  # (D, I)


class _CheckpointReader:
    """Lazy reader of the checkpoint's safetensors shards (``absorbed.safetensors`` excluded)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors") if p.name != "absorbed.safetensors")
        if not files:
            raise UserError(f"{folder} holds no safetensors weights; point at a folder written by `mha2mla convert`.")
        self._where: dict[str, object] = {}
        self._handles = []
        for name in files:
            handle = safe_open(str(folder / name), framework="pt")
            self._handles.append(handle)
            for key in handle.keys():
                self._where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"the checkpoint has no tensor {name!r}; is it a complete DeepSeek-V3 checkpoint?")
        tensor = self._where[name].get_tensor(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise UserError(f"{name} has shape {tuple(tensor.shape)}, the config implies {tuple(shape)}.")
        return tensor

    def optional(self, name: str, shape: Sequence[int]) -> torch.Tensor | None:
        return self.get(name, shape) if name in self else None


def _check_config(config) -> None:
    if getattr(config, "model_type", None) != "deepseek_v3":
        raise UserError(f"the model is a {config.model_type!r} checkpoint; `generate` needs a converted deepseek_v3 one.")
    if config.first_k_dense_replace < config.num_hidden_layers:
        raise UserError("the checkpoint has MoE layers (first_k_dense_replace < num_hidden_layers); only dense MLA models are supported.")
    if config.num_key_value_heads != config.num_attention_heads:
        raise UserError("num_key_value_heads must equal num_attention_heads in an MLA checkpoint.")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "dynamic":
        raise UserError("dynamic NTK rope scaling is not supported by the latent-cache engine; use plain rope or yarn.")


# ----------------------------------------------------------------------------------------------------------
# rope


class _Rope:
    """Rotary frequencies exactly as transformers' DeepseekV3RotaryEmbedding computes them (rope scaling
    included: the same ROPE_INIT_FUNCTIONS give inv_freq and the attention scaling; longrope switches to its
    long factors when a forward pass reaches past original_max_position_embeddings, as transformers does)."""

    def __init__(self, config, device):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

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
# generation results


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos" or "length"
    logits: torch.Tensor | None = None  # (len(tokens), V) fp32, when asked for


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV3RMSNorm: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). temperature <= 0 is greedy; top_p keeps the smallest set of most
    probable tokens whose mass reaches top_p."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always survives
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class _IncrementalDetokenizer:
    """Streams the text of each row as tokens arrive, holding back incomplete multi-byte characters."""

    def __init__(self, tokenizer, rows: int):
        self.tokenizer = tokenizer
        self.emitted = [0] * rows

    def push(self, row: int, tokens: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        new = text[self.emitted[row] :]
        self.emitted[row] = len(text)
        return new


# ----------------------------------------------------------------------------------------------------------
# the engine


class MLAEngine:
    def __init__(self, config, embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, device: torch.device, dtype: torch.dtype, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), decode_attention: str = "auto"):
        self.config = config
        self.embed = embed  # (V, D)
        self.layers = layers
        self.final_norm = final_norm  # (D,)
        self.lm_head = lm_head  # (V, D), the embedding itself when tied
        self.device = device
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_dim = config.qk_rope_head_dim
        self.nope_dim = config.qk_nope_head_dim
        self.v_dim = config.v_head_dim
        self.scale = softmax_scale(config)
        self.rope = _Rope(config, device)
        self.act = _activation(config.hidden_act)
        self._decode_attention = _decode_attention_for(device, decode_attention)

    # -- loading --------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, load_tokenizer: bool = True,
                        decode_attention: str = "auto") -> MLAEngine:
        """Load a converted checkpoint folder (config, safetensors, absorbed weights, tokenizer).

        dtype defaults to float32 on CPU and bfloat16 on CUDA. decode_attention: "torch" (plain PyTorch),
        "kernel" (mha2mla.kernels' split-KV decode), or "auto" (the kernel on CUDA, PyTorch on CPU)."""
        from transformers import AutoConfig

        folder = Path(folder)
        if not (folder / "config.json").exists():
            raise UserError(f"{folder} has no config.json; point at a folder written by `mha2mla convert`.")
        device = torch.device(device)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        config = AutoConfig.from_pretrained(folder)
        _check_config(config)
        index, absorbed = load_absorbed(folder)
        reader = _CheckpointReader(folder)

        H, D, r, d_r = config.num_attention_heads, config.hidden_size, config.kv_lora_rank, config.qk_rope_head_dim
        d_n, d_v, inter = config.qk_nope_head_dim, config.v_head_dim, config.intermediate_size
        for key, value in (("num_hidden_layers", config.num_hidden_layers), ("num_attention_heads", H),
                           ("kv_lora_rank", r), ("qk_nope_head_dim", d_n), ("v_head_dim", d_v)):
            if index.get(key) != value:
                raise UserError(f"absorbed.json says {key}={index.get(key)} but config.json says {value}; re-run `mha2mla convert`.")

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            kv_b = reader.get(p + "self_attn.kv_b_proj.weight", (H * (d_n + d_v), r))
            w_uk = absorbed[f"layers.{i}.w_uk"]
            w_uv = absorbed[f"layers.{i}.w_uv"]
            if tuple(w_uk.shape) != (H, d_n, r) or tuple(w_uv.shape) != (H, d_v, r):
                raise UserError(f"absorbed weights of layer {i} have shapes {tuple(w_uk.shape)}/{tuple(w_uv.shape)}, "
                                f"expected {(H, d_n, r)}/{(H, d_v, r)}; re-run `mha2mla convert`.")
            expect_uk, expect_uv = split_kv_b(kv_b.float(), H, d_n, d_v)
            tol = 1e-2 * float(kv_b.float().abs().max()) + 1e-6
            if (w_uk.float() - expect_uk).abs().max() > tol or (w_uv.float() - expect_uv).abs().max() > tol:
                raise UserError(f"absorbed.safetensors does not match kv_b_proj of layer {i} (stale after fine-tuning?); "
                                "rewrite it with mha2mla.modeling.absorbed.write_absorbed.")
            q_lora = config.q_lora_rank
            layers.append(LayerWeights(
                input_norm=put(reader.get(p + "input_layernorm.weight", (D,))),
                post_attention_norm=put(reader.get(p + "post_attention_layernorm.weight", (D,))),
                q_proj=put(reader.get(p + "self_attn.q_proj.weight", (H * (d_n + d_r), D))) if q_lora is None else None,
                q_a_proj=put(reader.get(p + "self_attn.q_a_proj.weight", (q_lora, D))) if q_lora else None,
                q_a_bias=put(reader.optional(p + "self_attn.q_a_proj.bias", (q_lora,))) if q_lora else None,
                q_a_norm=put(reader.get(p + "self_attn.q_a_layernorm.weight", (q_lora,))) if q_lora else None,
                q_b_proj=put(reader.get(p + "self_attn.q_b_proj.weight", (H * (d_n + d_r), q_lora))) if q_lora else None,
                kv_a_proj=put(reader.get(p + "self_attn.kv_a_proj_with_mqa.weight", (r + d_r, D))),
                kv_a_bias=put(reader.optional(p + "self_attn.kv_a_proj_with_mqa.bias", (r + d_r,))),
                kv_a_norm=put(reader.get(p + "self_attn.kv_a_layernorm.weight", (r,))),
                kv_b_proj=put(kv_b),
                w_uk=put(w_uk),
                w_uv_t=put(w_uv.transpose(1, 2)),
                o_proj=put(reader.get(p + "self_attn.o_proj.weight", (D, H * d_v))),
                o_bias=put(reader.optional(p + "self_attn.o_proj.bias", (D,))),
                gate_proj=put(reader.get(p + "mlp.gate_proj.weight", (inter, D))),
                up_proj=put(reader.get(p + "mlp.up_proj.weight", (inter, D))),
                down_proj=put(reader.get(p + "mlp.down_proj.weight", (D, inter))),
            ))
        embed = put(reader.get("model.embed_tokens.weight", (config.vocab_size, D)))
        if "lm_head.weight" in reader and not config.tie_word_embeddings:
            lm_head = put(reader.get("lm_head.weight", (config.vocab_size, D)))
        else:
            lm_head = embed
        final_norm = put(reader.get("model.norm.weight", (D,)))

        tokenizer = None
        if load_tokenizer:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(folder)
            except (OSError, ValueError):
                tokenizer = None
        eos = _eos_ids(folder, config, tokenizer)
        return cls(config, embed, layers, final_norm, lm_head, device, dtype, tokenizer, eos, decode_attention)

    # -- cache ---------------------------------------------------------------------------------------------

    def new_cache(self, batch_size: int, max_tokens: int) -> LatentCache:
        return LatentCache.allocate(self.config.num_hidden_layers, batch_size, max_tokens, self.kv_lora_rank,
                                    self.rope_dim, self.dtype, self.device)

    # -- forward passes --------------------------------------------------------------------------------------

    def _query(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> q (..., H*(d_n+d_r))."""
        if w.q_proj is not None:
            return _linear(x, w.q_proj)
        q_latent = _rms_norm(_linear(x, w.q_a_proj, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS)
        return _linear(q_latent, w.q_b_proj)

    def _latent(self, w: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., D) -> normalised latent c (..., r), un-rotated rope key (..., d_r)."""
        compressed = _linear(x, w.kv_a_proj, w.kv_a_bias)  # (..., r + d_r)
        latent, rope_key = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return _rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS), rope_key

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.act(_linear(x, w.gate_proj)) * _linear(x, w.up_proj), w.down_proj)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(_rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head).float()

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
        positions = torch.arange(T, device=self.device)
        cos, sin = self.rope.cos_sin(positions, self.dtype)  # (T, d_r/2)
        hidden = F.embedding(ids, self.embed)  # (B, T, D)
        for index, w in enumerate(self.layers):
            x = _rms_norm(hidden, w.input_norm, self.config.rms_norm_eps)
            q = self._query(w, x).view(B, T, H, d_n + d_r).transpose(1, 2)  # (B, H, T, d_n+d_r)
            q_nope, q_pe = q.split([d_n, d_r], dim=-1)
            latent, rope_key = self._latent(w, x)  # (B, T, r), (B, T, d_r)
            q_pe = self.rope.apply(q_pe, cos, sin)
            rope_key = self.rope.apply(rope_key, cos, sin)
            cache.write_prefill(index, latent, rope_key)
            kv = _linear(latent, w.kv_b_proj).view(B, T, H, d_n + d_v).transpose(1, 2)  # (B, H, T, d_n+d_v)
            k_nope, value = kv.split([d_n, d_v], dim=-1)
            key = torch.cat([k_nope, rope_key[:, None].expand(B, H, T, d_r)], dim=-1)  # (B, H, T, d_n+d_r)
            query = torch.cat([q_nope, q_pe], dim=-1)
            attn = _causal_attention(query, key, value, self.scale)  # (B, H, T, d_v)
            attn = attn.transpose(1, 2).reshape(B, T, H * d_v)
            hidden = hidden + _linear(attn, w.o_proj, w.o_bias)
            hidden = hidden + self._mlp(w, _rms_norm(hidden, w.post_attention_norm, self.config.rms_norm_eps))
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
        hidden = F.embedding(tokens.to(self.device), self.embed)  # (B, D)
        for index, w in enumerate(self.layers):
            x = _rms_norm(hidden, w.input_norm, self.config.rms_norm_eps)
            q = self._query(w, x).view(B, H, d_n + d_r)
            q_nope, q_pe = q.split([d_n, d_r], dim=-1)
            q_pe = self.rope.apply(q_pe, cos[:, None], sin[:, None])  # (B, H, d_r)
            latent, rope_key = self._latent(w, x)  # (B, r), (B, d_r)
            rope_key = self.rope.apply(rope_key, cos, sin)
            cache.write_step(index, latent, rope_key)
            q_latent = torch.matmul(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # (B, H, r) = W_UK^T q_nope
            query = torch.cat([q_latent, q_pe], dim=-1)  # (B, H, r + d_r)
            out_latent = self._decode_attention(query, cache.layer(index), lengths_after, max_after, r, self.scale)  # (B, H, r)
            out = torch.matmul(out_latent.transpose(0, 1), w.w_uv_t).transpose(0, 1)  # (B, H, d_v)
            hidden = hidden + _linear(out.reshape(B, H * d_v), w.o_proj, w.o_bias)
            hidden = hidden + self._mlp(w, _rms_norm(hidden, w.post_attention_norm, self.config.rms_norm_eps))
        cache.advance()
        return self._logits(hidden)

    # -- generation ------------------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError("the model folder has no tokenizer; pass token ids instead of text.")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stream: StreamCallback | None = None,
        eos_token_ids: Sequence[int] | None = None,
        return_logits: bool = False,
    ) -> list[Generation]:
        """Generate up to ``max_new_tokens`` for every prompt (text or token ids), batched with ragged lengths.

        Greedy when temperature is 0, else sampling with temperature and top-p from a generator seeded with
        ``seed``. A row stops at its first EOS token (kept in ``tokens``, not in ``text``). ``stream(row, text)``
        receives each row's new text as it is produced."""
        if not prompts:
            raise UserError("give at least one prompt.")
        if max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1.")
        if not 0.0 < top_p <= 1.0:
            raise UserError("top-p must be in (0, 1].")
        encoded = [self.encode(p) for p in prompts]
        results = [Generation(prompt_tokens=ids) for ids in encoded]
        eos = set(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()  # non-deterministic, without touching torch's global generator
            else:
                generator.manual_seed(seed)
        cache = self.new_cache(len(encoded), max(len(ids) for ids in encoded) + max_new_tokens)
        detok = _IncrementalDetokenizer(self.tokenizer, len(encoded)) if self.tokenizer is not None else None
        step_logits: list[list[torch.Tensor]] = [[] for _ in encoded]
        finished = [False] * len(encoded)

        logits = self.prefill(cache, encoded)
        for step in range(max_new_tokens):
            next_tokens = sample_next(logits, temperature, top_p, generator)  # (B,)
            for row, token in enumerate(next_tokens.tolist()):
                if finished[row]:
                    continue
                results[row].tokens.append(token)
                if return_logits:
                    step_logits[row].append(logits[row].cpu())
                if token in eos:
                    finished[row] = True
                    results[row].finish_reason = "eos"
                if detok is not None and stream is not None:
                    last = finished[row] or step == max_new_tokens - 1
                    piece = detok.push(row, results[row].tokens, final=last)
                    if piece:
                        stream(row, piece)
            if all(finished) or step == max_new_tokens - 1:
                break
            logits = self.decode(cache, next_tokens)
        for row, result in enumerate(results):
            if self.tokenizer is not None:
                result.text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
            if return_logits:
                result.logits = torch.stack(step_logits[row])
        return results


# ----------------------------------------------------------------------------------------------------------
# helpers


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
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


def _decode_attention_for(device: torch.device, choice: str = "auto"):
    """The absorbed decode attention: plain PyTorch on CPU; on CUDA the split-KV Triton kernel of
    mha2mla.kernels (a warning, and PyTorch, if that package is missing). "kernel" insists on the kernel
    module (on CPU tensors it then runs in Triton's interpreter when TRITON_INTERPRET=1, else its reference)."""
    if choice not in DECODE_ATTENTION:
        raise UserError(f"decode attention {choice!r} is not one of {', '.join(DECODE_ATTENTION)}.")
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return absorbed_decode_attention_torch
    if importlib.util.find_spec(ABSORBED_KERNEL_MODULE) is None:
        if choice == "kernel":
            raise UserError(f"{ABSORBED_KERNEL_MODULE} is not installed; use decode attention 'torch'.")
        import logging

        logging.getLogger(__name__).warning(
            "%s is not available; decoding with the PyTorch absorbed attention on CUDA.", ABSORBED_KERNEL_MODULE
        )
        return absorbed_decode_attention_torch
    return absorbed_decode_attention_kernel


def _eos_ids(folder: Path, config, tokenizer) -> list[int]:
    ids: set[int] = set()

    def add(value):
        if value is None:
            return
        ids.update([value] if isinstance(value, int) else value)

    add(config.eos_token_id)
    generation_config = folder / "generation_config.json"
    if generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return sorted(ids)


def cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes the latent cache holds per token, all layers: (r + d_r) * layers * element size."""
    element = torch.empty((), dtype=dtype).element_size()
    return (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * element


__all__ = ["Generation", "LatentCache", "MLAEngine", "cache_bytes_per_token", "sample_next"]
