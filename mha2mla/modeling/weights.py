"""The tensors of one converted layer, read and checked from a DeepSeek-V3 checkpoint for the latent-cache model
(model.py): the checkpoint's config must describe MLA as this package writes it, and the absorbed weights must
match kv_b_proj."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha2mla import UserError
from mha2mla.io.reader import LazyCheckpoint
from mha2mla.modeling.absorbed import split_kv_b


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


def check_config(config) -> None:
    """Refuse configs the model does not compute: other architectures, MoE layers, GQA, dynamic NTK rope."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        raise UserError(f"the model is a {config.model_type!r} checkpoint; `generate` needs a converted deepseek_v3 one.")
    if config.first_k_dense_replace < config.num_hidden_layers:
        raise UserError("the checkpoint has MoE layers (first_k_dense_replace < num_hidden_layers); only dense MLA models are supported.")
    if config.num_key_value_heads != config.num_attention_heads:
        raise UserError("num_key_value_heads must equal num_attention_heads in an MLA checkpoint.")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "dynamic":
        raise UserError("dynamic NTK rope scaling is not supported by the latent-cache model; use plain rope or yarn.")


def check_absorbed_index(index: dict, config) -> None:
    for key in ("num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        value = getattr(config, key)
        if index.get(key) != value:
            raise UserError(f"absorbed.json says {key}={index.get(key)} but config.json says {value}; re-run `mha2mla convert`.")


def _check_absorbed_layer(layer: int, kv_b: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, config) -> None:
    """The absorbed factors must have the config's shapes and be the split of this layer's kv_b_proj."""
    H, d_n, d_v, r = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    if tuple(w_uk.shape) != (H, d_n, r) or tuple(w_uv.shape) != (H, d_v, r):
        raise UserError(f"absorbed weights of layer {layer} have shapes {tuple(w_uk.shape)}/{tuple(w_uv.shape)}, "
                        f"expected {(H, d_n, r)}/{(H, d_v, r)}; re-run `mha2mla convert`.")
    expect_uk, expect_uv = split_kv_b(kv_b.float(), H, d_n, d_v)
    tol = 1e-2 * float(kv_b.float().abs().max()) + 1e-6
    if (w_uk.float() - expect_uk).abs().max() > tol or (w_uv.float() - expect_uv).abs().max() > tol:
        raise UserError(f"absorbed.safetensors does not match kv_b_proj of layer {layer} (stale after fine-tuning?); "
                        "rewrite it with mha2mla.modeling.absorbed.write_absorbed.")


def load_layer(reader: LazyCheckpoint, absorbed: dict[str, torch.Tensor], config, layer: int, put) -> LayerWeights:
    """Layer ``layer``'s tensors, shape-checked against the config and moved by ``put`` to the model's device/dtype."""
    H, D, r, d_r = config.num_attention_heads, config.hidden_size, config.kv_lora_rank, config.qk_rope_head_dim
    d_n, d_v, inter, q_lora = config.qk_nope_head_dim, config.v_head_dim, config.intermediate_size, config.q_lora_rank
    p = f"model.layers.{layer}."

    def get(name: str, *shape: int) -> torch.Tensor:
        return put(reader.get(p + name, dtype=None, shape=shape))

    def optional(name: str, *shape: int) -> torch.Tensor | None:
        tensor = reader.optional(p + name, dtype=None, shape=shape)
        return None if tensor is None else put(tensor)

    kv_b = reader.get(p + "self_attn.kv_b_proj.weight", dtype=None, shape=(H * (d_n + d_v), r))
    w_uk, w_uv = absorbed[f"layers.{layer}.w_uk"], absorbed[f"layers.{layer}.w_uv"]
    _check_absorbed_layer(layer, kv_b, w_uk, w_uv, config)
    return LayerWeights(
        input_norm=get("input_layernorm.weight", D),
        post_attention_norm=get("post_attention_layernorm.weight", D),
        q_proj=get("self_attn.q_proj.weight", H * (d_n + d_r), D) if q_lora is None else None,
        q_a_proj=get("self_attn.q_a_proj.weight", q_lora, D) if q_lora else None,
        q_a_bias=optional("self_attn.q_a_proj.bias", q_lora) if q_lora else None,
        q_a_norm=get("self_attn.q_a_layernorm.weight", q_lora) if q_lora else None,
        q_b_proj=get("self_attn.q_b_proj.weight", H * (d_n + d_r), q_lora) if q_lora else None,
        kv_a_proj=get("self_attn.kv_a_proj_with_mqa.weight", r + d_r, D),
        kv_a_bias=optional("self_attn.kv_a_proj_with_mqa.bias", r + d_r),
        kv_a_norm=get("self_attn.kv_a_layernorm.weight", r),
        kv_b_proj=put(kv_b),
        w_uk=put(w_uk),
        w_uv_t=put(w_uv.transpose(1, 2)),
        o_proj=get("self_attn.o_proj.weight", D, H * d_v),
        o_bias=optional("self_attn.o_proj.bias", D),
        gate_proj=get("mlp.gate_proj.weight", inter, D),
        up_proj=get("mlp.up_proj.weight", inter, D),
        down_proj=get("mlp.down_proj.weight", D, inter),
    )
