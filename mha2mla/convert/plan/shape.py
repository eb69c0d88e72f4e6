"""The source model's shape as the conversion needs it, read once from config.json and the family's data."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from mha2mla import UserError
from mha2mla.families import Family

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim")  # absent or null: MHA, and hidden_size / heads


@dataclass(frozen=True)
class SourceShape:
    hidden_size: int  # D
    num_heads: int  # H
    num_kv_heads: int  # G
    head_dim: int  # d
    num_layers: int  # L
    rope_theta: float
    vocab_size: int
    intermediate_size: int
    rotary_dim: int = 0  # R: the dims of a head that rotate (d, or d × partial_rotary_factor); 0 means d
    attention_scale: float = 0.0  # the source's softmax scale (d^-0.5 unless the family sets it); 0 means d^-0.5
    rope_layers: tuple[bool, ...] = ()  # per layer: whether it applies rope (empty: every layer)
    embedding_scale: float = 1.0  # the family's multipliers, folded into the weights (docs/convert.md)
    residual_scale: float = 1.0
    logits_scale: float = 1.0  # logits are divided by it
    rope_scaling: str = "default"  # the source's rope_type
    rotation_gain: float = 1.0  # what the rope scaling multiplies rotated q·k terms by (longrope's attention factor²)

    @classmethod
    def from_config(cls, config: dict, family: Family | None = None) -> SourceShape:
        missing = [key for key in REQUIRED_CONFIG_KEYS if config.get(key) is None]
        if missing:
            raise UserError(f"the source config.json lacks {', '.join(missing)}; it is incomplete or not a causal LM config.")
        _check_sizes(config)
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        rope = config.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise UserError(f"the source config.json's rope_parameters is {_shown(rope)}, not a mapping of rope settings; "
                            f"{_FIX}.")
        theta = _number(config, "rope_theta", rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        partial = _number(config, "partial_rotary_factor",
                          rope.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0)
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or rotary_dim < 2:
            raise UserError(f"partial_rotary_factor {partial} leaves {rotary_dim} rotating dims per head; RoPE needs an even number.")
        rope_layers = ()
        if family is not None and family.rope_layers_key and config.get(family.rope_layers_key) is not None:
            rope_layers = _rope_layers(config, family.rope_layers_key)
        scale = (lambda kind: family.scale(kind, config)) if family is not None else (lambda kind: 1.0)
        attention_multiplier = family.scale("attention", config) if family is not None and "attention" in family.scales else 0.0
        return cls(
            hidden_size=config["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            num_layers=config["num_hidden_layers"],
            rope_theta=float(theta),
            vocab_size=config["vocab_size"],
            intermediate_size=config["intermediate_size"],
            rotary_dim=rotary_dim,
            attention_scale=attention_multiplier,
            rope_layers=rope_layers,
            embedding_scale=scale("embedding"),
            residual_scale=scale("residual"),
            logits_scale=scale("logits"),
            rope_scaling=rope.get("rope_type", rope.get("type")) or "default",
            rotation_gain=_attention_factor(rope, config) ** 2,
        )

    @property
    def rotating_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    def layer_uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    @property
    def kv_values_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def max_latent_rank(self) -> int:
        """The rank of [K_nope; V]: at most its rows and the hidden size."""
        return min(self.hidden_size, self.kv_values_per_token_per_layer)


_FIX = "fix config.json or re-download the model"


def _shown(value) -> str:
    """A config value as written in JSON; a list or mapping by its kind."""
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "a mapping"
    return json.dumps(value)


def _check_sizes(config: dict) -> None:
    """The source's sizes are positive whole numbers and its heads split evenly: num_key_value_heads divides
    num_attention_heads, and hidden_size does where head_dim is not given. One sentence naming the key otherwise."""
    for key in REQUIRED_CONFIG_KEYS + OPTIONAL_SIZE_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            why = (f"it must be a positive divisor of num_attention_heads ({_shown(config['num_attention_heads'])})"
                   if key == "num_key_value_heads" else "it must be a positive whole number")
            raise UserError(f"the source config.json has {key} {_shown(value)}, which is invalid: {why}; {_FIX}.")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise UserError(f"the source config.json has num_key_value_heads {kv_heads}, which is invalid: it must be a "
                        f"positive divisor of num_attention_heads ({heads}); {_FIX}.")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise UserError(f"the source config.json has no head_dim and hidden_size {config['hidden_size']} is not a "
                        f"multiple of num_attention_heads {heads}; {_FIX}.")


def _number(config: dict, key: str, value) -> float:
    """A positive real number of the rope settings (rope_theta, partial_rotary_factor), or one sentence."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise UserError(f"the source config.json has {key} {_shown(value)}, which is invalid: it must be a positive "
                        f"number; {_FIX}.")
    return float(value)


def _rope_layers(config: dict, key: str) -> tuple[bool, ...]:
    """The family's per-layer rope flags: a list of one 0 or 1 per layer."""
    flags = config[key]
    if not isinstance(flags, list) or len(flags) != config["num_hidden_layers"]:
        raise UserError(f"the source config.json has {key} {_shown(flags)}, which is invalid: it must list one 0 or 1 "
                        f"per layer ({config['num_hidden_layers']}); {_FIX}.")
    return tuple(bool(flag) for flag in flags)


def _attention_factor(rope: dict, config: dict) -> float:
    """longrope scales cos and sin by an attention factor (so every rotated q·k term by its square); the
    other scalings the conversion meets (llama3, linear) scale frequencies only."""
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    factor = rope.get("factor") or (config.get("max_position_embeddings", original) / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
