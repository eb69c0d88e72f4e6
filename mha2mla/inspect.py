"""``inspect_model``: what a model is and which MLA budgets it can be converted to."""

from __future__ import annotations

from mha2mla.convert.options import ConvertOptions
from mha2mla.convert.plan import SourceShape, make_plan
from mha2mla.families import family_for_config
from mha2mla.io.source import resolve_source


def inspect_model(model: str) -> dict:
    import json

    folder = resolve_source(model)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") == "deepseek_v3":
        layers = config["num_hidden_layers"]
        values = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return {
            "family": "deepseek_v3 (MLA)",
            "layers": layers,
            "heads": config["num_attention_heads"],
            "kv_lora_rank": config["kv_lora_rank"],
            "qk_rope_head_dim": config["qk_rope_head_dim"],
            "qk_nope_head_dim": config["qk_nope_head_dim"],
            "v_head_dim": config["v_head_dim"],
            "rope": config.get("rope_parameters"),
            "kv_values_per_token_per_layer": values,
            "kv_bytes_per_token_bf16": values * layers * 2,
            "converted_by": config.get("mha2mla"),
        }
    family = family_for_config(config)
    shape = SourceShape.from_config(config)
    values = shape.kv_values_per_token_per_layer
    budgets = []
    for budget in (0.5, 0.3125, 0.25, 0.1875, 0.125, 0.0625):
        try:
            plan = make_plan(config, family, ConvertOptions(kv_budget=budget))
        except Exception:  # a budget too small for this model
            continue
        budgets.append({
            "kv_budget": budget,
            "values_per_token_per_layer": plan.kv_lora_rank + plan.rope_dim,
            "kv_lora_rank": plan.kv_lora_rank,
            "rope_dim": plan.rope_dim,
            "kv_bytes_per_token": (plan.kv_lora_rank + plan.rope_dim) * shape.num_layers * 2,
        })
    return {
        "family": family.name,
        "architecture": (config.get("architectures") or ["?"])[0],
        "layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "query_heads": shape.num_heads,
        "kv_heads": shape.num_kv_heads,
        "attention": "MHA" if shape.num_heads == shape.num_kv_heads else ("MQA" if shape.num_kv_heads == 1 else "GQA"),
        "head_dim": shape.head_dim,
        "rope": config.get("rope_parameters") or {"rope_theta": shape.rope_theta},
        "dtype": config.get("dtype") or config.get("torch_dtype"),
        "kv_values_per_token_per_layer": values,
        "kv_bytes_per_token": values * shape.num_layers * 2,
        "kv_bytes_per_token_dtype": "bf16 (2 bytes per value)",
        "max_latent_rank": shape.max_latent_rank,
        "budgets": budgets,
    }
