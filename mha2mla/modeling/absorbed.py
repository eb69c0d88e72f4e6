"""Absorbed inference weights (docs/generate.md, docs/kernels.md).

For a DeepSeek-V3 layer, ``kv_b_proj.weight`` has shape ``[H * (d_n + d_v), r]``; per head ``h`` its
first ``d_n`` rows are W_UK[h] and the next ``d_v`` rows are W_UV[h]. Decoding from the latent cache
never expands keys or values per head:

    q_lat[h]  = W_UK[h]^T q_nope[h]                      # (r,)   absorb W_UK into the query
    score[t]  = (q_lat[h] . c[t] + q_pe[h] . k_pe[t]) * softmax_scale
    o_lat[h]  = sum_t p[t] c[t]                          # (r,)
    out[h]    = W_UV[h] o_lat[h]                         # (d_v,) then o_proj

where ``c[t]`` is the *normalised* latent (after ``kv_a_layernorm``) and ``k_pe[t]`` the rotated rope key,
which is exactly what the cache stores (``r + d_r`` values per token per layer).

File format: ``absorbed.safetensors`` with, for every layer ``i``,
``layers.{i}.w_uk``: ``[H, d_n, r]`` and ``layers.{i}.w_uv``: ``[H, d_v, r]``, plus ``absorbed.json``
describing the shapes, the softmax scale and the dtype. This module computes and writes them; reading them back
from a folder is mha2mla/io/mla_checkpoint.py's ``load_absorbed``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mha2mla.io.mla_checkpoint import FORMAT_NAME, FORMAT_VERSION
from mha2mla.io.model_folder import ABSORBED_FILE, ABSORBED_INDEX


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """``kv_b_proj.weight`` [H*(d_n+d_v), r] -> (W_UK [H, d_n, r], W_UV [H, d_v, r])."""
    rank = kv_b_weight.shape[1]
    per_head = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, rank)  # (H, d_n+d_v, r)
    return per_head[:, :qk_nope_head_dim].contiguous(), per_head[:, qk_nope_head_dim:].contiguous()


def softmax_scale(config) -> float:
    """The softmax scale transformers' DeepseekV3 uses (mscale included when rope scaling asks for it)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    return float(yarn_apply_mscale(config.rope_parameters, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5))


def absorbed_tensors(state_dict_or_getter, config) -> dict[str, torch.Tensor]:
    """Absorbed factors for every layer. ``state_dict_or_getter`` maps tensor names to tensors
    (a dict, or a callable ``name -> tensor`` for lazy reading)."""
    get = state_dict_or_getter if callable(state_dict_or_getter) else state_dict_or_getter.__getitem__
    tensors = {}
    for layer in range(config.num_hidden_layers):
        kv_b = get(f"model.layers.{layer}.self_attn.kv_b_proj.weight")
        w_uk, w_uv = split_kv_b(kv_b, config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim)
        tensors[f"layers.{layer}.w_uk"] = w_uk
        tensors[f"layers.{layer}.w_uv"] = w_uv
    return tensors


def write_absorbed(folder: str | Path, state_dict_or_getter, config) -> None:
    folder = Path(folder)
    tensors = absorbed_tensors(state_dict_or_getter, config)
    save_file(tensors, str(folder / ABSORBED_FILE), metadata={"format": FORMAT_NAME})
    any_tensor = next(iter(tensors.values()))
    index = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "softmax_scale": softmax_scale(config),
        "dtype": str(any_tensor.dtype).removeprefix("torch."),
        "tensors": {
            "layers.{i}.w_uk": [config.num_attention_heads, config.qk_nope_head_dim, config.kv_lora_rank],
            "layers.{i}.w_uv": [config.num_attention_heads, config.v_head_dim, config.kv_lora_rank],
        },
        "cache_values_per_token_per_layer": config.kv_lora_rank + config.qk_rope_head_dim,
    }
    (folder / ABSORBED_INDEX).write_text(json.dumps(index, indent=2) + "\n")
