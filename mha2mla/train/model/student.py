"""The student of a recovery run: the converted DeepSeek-V3 MLA model, loaded with the attention kernel the run
trains it with (``auto``: chosen from the GPU measurements, mha2mla/kernels/speed_table.py), its latents balanced
(latents.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from transformers import AttentionInterface

from mha2mla import UserError
from mha2mla.io.loader import load_causal_lm
from mha2mla.io.model_folder import check_model_folder
from mha2mla.train.model.latents import balance_latent_scales

TRITON_ATTENTION = "mha2mla_triton"
STUDENT_HINT = "give the output folder of `mha2mla convert`"  # what a model folder that does not read back needs


def resolve_attn_implementation(name: str, device_type: str = "cpu", compute_dtype: str = "float32",
                                model_config: dict | None = None) -> str:
    """``sdpa`` / ``eager`` as they are; ``mha2mla_triton`` once the kernels package registers it with
    transformers' ``AttentionInterface`` (importing ``mha2mla.kernels`` is expected to do so); ``auto``: the kernel
    where a GPU measurement shows it at least as fast as SDPA here, else ``sdpa`` (mha2mla/kernels/speed_table.py)."""
    if name == "auto":
        from mha2mla.kernels.speed_table import training_attention

        name = training_attention(device_type, compute_dtype, model_config or {})
    if name != TRITON_ATTENTION:
        return name
    try:
        importlib.import_module("mha2mla.kernels")
    except ImportError:
        pass
    if name not in AttentionInterface._global_mapping:
        raise UserError(
            f"attention implementation {name!r} is not available (the Triton MLA kernel is not registered); "
            "use --attn-implementation sdpa."
        )
    return name


def read_model_config(folder: str | Path) -> dict:
    """config.json of a model folder, every weight file checked to read back (mha2mla/io/model_folder.py)."""
    return check_model_folder(folder, hint=STUDENT_HINT)


def load_student(folder: str | Path, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                 device_type: str = "cpu", compute_dtype: str = "float32"):
    """The converted model of ``folder``, its folder checked first (``build_student`` on its config)."""
    return build_student(folder, read_model_config(folder), attn_implementation, dtype, device_type, compute_dtype)


def build_student(folder: str | Path, model_config: dict, attn_implementation: str = "sdpa",
                  dtype: torch.dtype = torch.float32, device_type: str = "cpu", compute_dtype: str = "float32"):
    """The converted DeepSeek-V3 MLA model of ``folder`` (``model_config``: its config.json, already read), in
    ``dtype`` (fp32 master weights for training); ``sdpa`` runs as ``mha2mla_sdpa`` (mha2mla/kernels/sdpa.py) so
    that the fused kernels serve MLA's unequal head dims."""
    if model_config.get("model_type") != "deepseek_v3":
        raise UserError(
            f"{folder} is a {model_config.get('model_type')!r} model, not a converted DeepSeek-V3 MLA model; "
            "run `mha2mla convert` first."
        )
    name = resolve_attn_implementation(attn_implementation, device_type, compute_dtype, model_config)
    model = load_causal_lm(folder, dtype, attention=name)  # sdpa as mha2mla_sdpa (io/loader.py)
    model.config.use_cache = False
    balance_latent_scales(model)
    return model
