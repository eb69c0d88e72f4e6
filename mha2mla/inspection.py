"""``inspect_model``: what a model is and which MLA budgets it can be converted to.

KV bytes per token are counted as the plan counts them (``ConversionPlan.kv_bytes_per_token``): every layer's cached
values times the bytes per value of the dtype a default ``mha2mla convert`` writes, named in ``kv_dtype``.
"""

from __future__ import annotations

from pathlib import Path

from mha2mla import UserError
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.plan.resolve import make_plan
from mha2mla.convert.plan.shape import DTYPES, SourceShape
from mha2mla.families import family_for_config
from mha2mla.io.model_folder import is_gguf_name, read_config
from mha2mla.io.source import check_source, gguf_config, resolve_source

BUDGETS = (0.5, 0.3125, 0.25, 0.1875, 0.125, 0.0625)
MLA_KEYS = ("num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _dtype_label(name: str) -> str:
    return f"{name} ({DTYPES[name].itemsize} bytes per value)"


def _mla_info(config: dict) -> dict:
    """A converted (DeepSeek-V3) model: its cache in the dtype it is stored in."""
    missing = [key for key in MLA_KEYS if config.get(key) is None]
    if missing:
        raise UserError(f"the deepseek_v3 config.json lacks {', '.join(missing)}; it is incomplete.")
    layers = config["num_hidden_layers"]
    values = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    dtype = dtype if dtype in DTYPES else "float32"
    return {
        "family": "deepseek_v3 (MLA)",
        "layers": layers,
        "heads": config["num_attention_heads"],
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_rope_head_dim": config["qk_rope_head_dim"],
        "qk_nope_head_dim": config["qk_nope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        "rope": rope_text(config.get("rope_parameters") or config.get("rope_scaling")),
        "kv_values_per_token_per_layer": values,
        "kv_bytes_per_token": values * layers * DTYPES[dtype].itemsize,
        "kv_dtype": _dtype_label(dtype),
        "converted_by": config.get("mha2mla"),
    }


def rope_text(rope: dict | None) -> str:
    """A rope config as a line of text: its type, theta, then any scaling settings (``llama3, theta 500000, factor
    8.0, ...``)."""
    rope = dict(rope or {})
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    theta = rope.pop("rope_theta", None)
    parts = [str(kind)] + ([f"theta {theta:g}"] if isinstance(theta, (int, float)) else [])
    for key, value in rope.items():
        shown = f"{len(value)} values" if isinstance(value, (list, tuple)) else f"{value:g}" if isinstance(value, float) else value
        parts.append(f"{key} {shown}")
    return ", ".join(parts)


def approximations(family, rope: dict | None) -> str:
    """What a conversion of this source approximates: the family's list without the rope scalings the source does
    not use (``llama3 rope scaling`` only for a llama3 rope)."""
    kind = str((rope or {}).get("rope_type") or (rope or {}).get("type") or "default")
    parts = [part for part in (family.approximated or "").split("; ")
             if " scaling" not in part or part.split(" ")[0] == kind]
    return "; ".join(part for part in parts if part) or "nothing beyond the rope and rank cuts"


def _budgets(config: dict, family, source_format: str) -> tuple[list[dict], str]:
    """The default conversion at each budget this model reaches (a budget too small for it is left out), and the
    dtype those conversions write."""
    rows, dtype = [], None
    for budget in BUDGETS:
        try:
            plan = make_plan(config, family, ConvertConfig(kv_budget=budget), source_format=source_format)
        except UserError:
            continue
        dtype = plan.dtype
        rows.append({
            "kv_budget": budget,
            "values_per_token_per_layer": plan.kv_lora_rank + plan.rope_dim,
            "kv_lora_rank": plan.kv_lora_rank,
            "rope_dim": plan.rope_dim,
            "kv_bytes_per_token": plan.kv_bytes_per_token()["converted"],
        })
    return rows, dtype or "float32"


def _source_config(model: str) -> dict:
    """The config of ``model``: a .gguf file's from its metadata (its weights are never dequantised for this), any
    other source's config.json."""
    check_source(model)
    if Path(model).expanduser().is_file():
        return gguf_config(Path(model).expanduser())
    return read_config(resolve_source(model))


def inspect_model(model: str) -> dict:
    """Family, shape, rope, KV bytes per token (``kv_dtype``) and the reachable budgets of ``model``."""
    config = _source_config(model)
    if config.get("model_type") == "deepseek_v3":
        return _mla_info(config)
    family = family_for_config(config)
    shape = SourceShape.from_config(config, family)
    source_format = "gguf" if is_gguf_name(model) else "safetensors"
    budgets, dtype = _budgets(config, family, source_format)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {"rope_theta": shape.rope_theta}
    return {
        "family": family.name,
        "architecture": (config.get("architectures") or ["?"])[0],
        "layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "query_heads": shape.num_heads,
        "kv_heads": shape.num_kv_heads,
        "attention": "MHA" if shape.num_heads == shape.num_kv_heads else ("MQA" if shape.num_kv_heads == 1 else "GQA"),
        "head_dim": shape.head_dim,
        "rope": rope_text(rope),
        "source_dtype": "GGUF (quantised or half precision; dequantised to float32 to convert)"
        if source_format == "gguf" else str(config.get("dtype") or config.get("torch_dtype")),
        "kv_values_per_token_per_layer": shape.kv_values_per_token_per_layer,
        "kv_bytes_per_token": shape.kv_values_per_token_per_layer * shape.num_layers * DTYPES[dtype].itemsize,
        "kv_dtype": _dtype_label(dtype) + ", the dtype `mha2mla convert` writes by default",
        "max_latent_rank": shape.max_latent_rank,
        "exact_at_full_capacity": family.exact,
        "approximated": approximations(family, rope),
        "budgets": budgets,
    }
