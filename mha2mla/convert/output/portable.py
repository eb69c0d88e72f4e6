"""The portable-profile checker (docs/design.md §2): config + tensor names only, no weights loaded.

vLLM's and SGLang's DeepSeek attention builds q_proj / kv_a_proj_with_mqa / o_proj without
biases, accepts only a silu MLP, applies rope in the interleaved (GPT-J) layout, and overwrites
any rope scaling with its own deepseek_yarn. A checkpoint that breaks one of these loads in
transformers and silently produces something else in a serving engine.
"""

from __future__ import annotations

import re
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import INDEX_FILE, SINGLE_FILE, read_config, read_index

SERVING_ROPE_TYPES = {"default", "yarn", "deepseek_yarn"}
ATTENTION_MODULES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def portable_violations(config: dict, tensor_names: list[str]) -> list[str]:
    """Every way ``config`` + ``tensor_names`` would break in vLLM / SGLang (empty: portable)."""
    problems = []
    if config.get("model_type") != "deepseek_v3":
        problems.append(f"model_type is {config.get('model_type')!r}, not 'deepseek_v3'")
    if config.get("architectures") != ["DeepseekV3ForCausalLM"]:
        problems.append(f"architectures is {config.get('architectures')!r}, not ['DeepseekV3ForCausalLM']")
    if config.get("attention_bias"):
        problems.append("attention_bias is true, but serving engines build DeepSeek attention without biases")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {config.get('hidden_act')!r}, but serving engines' DeepSeek MLP is silu only")
    if config.get("rope_interleave") is not True:
        problems.append("rope_interleave is not true, but serving engines apply DeepSeek rope in the interleaved layout")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SERVING_ROPE_TYPES:
        problems.append(f"rope type {rope_type!r} is not one the serving engines apply (plain rope or yarn)")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if kv_heads != heads:
        problems.append(f"num_key_value_heads ({kv_heads}) differs from num_attention_heads ({heads})")
    layers = config.get("num_hidden_layers")
    if config.get("first_k_dense_replace") != layers:
        problems.append("first_k_dense_replace is not num_hidden_layers: some layers would be built as MoE")
    if config.get("num_nextn_predict_layers", 0):
        problems.append("num_nextn_predict_layers is not 0, but the checkpoint has no MTP layers")
    attention_bias = re.compile(r"self_attn\.(" + "|".join(ATTENTION_MODULES) + r")\.bias$")
    biased = [name for name in tensor_names if attention_bias.search(name)]
    if biased:
        problems.append(f"{len(biased)} attention bias tensors (e.g. {biased[0]}) would be dropped by serving engines")
    return problems


def check_portable_folder(folder: str | Path) -> list[str]:
    """The portable profile's violations in a converted folder: its config.json and its weights' tensor names."""
    folder = Path(folder)
    config = read_config(folder)
    index = folder / INDEX_FILE
    if index.exists():
        names = list(read_index(index))
    else:
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE_FILE), framework="pt") as handle:
            names = list(handle.keys())
    return portable_violations(config, names)


def assert_portable(folder: str | Path) -> None:
    problems = check_portable_folder(folder)
    if problems:
        raise UserError(f"the output is not portable: {problems[0]}.")
