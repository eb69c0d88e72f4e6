"""Load what ``mha2mla eval`` evaluates: a local Hugging Face folder, a ``.gguf`` file, or a hub id when online.

Every path ends in a causal LM on one device in eval mode plus its tokenizer, so a model loaded here and
one passed in from memory go through exactly the same evaluation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.devices import resolve_device
from mha2mla.io.cache import cached_default_model
from mha2mla.io.model_folder import check_model_folder, source_kind
from mha2mla.modeling.sdpa import mla_attention_for

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # a short label for tables and plots
    path: str  # what the user passed, resolved
    kind: str  # "folder" | "gguf" | "hub"


def resolve_dtype(dtype: str | torch.dtype | None):
    """``"auto"`` (the checkpoint's own dtype, lm-eval's default too) or one of DTYPES."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype or "auto"
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def gguf_dtype(dtype):
    """The dtype a GGUF model computes in: ``auto`` is bfloat16, the dtype a conversion of a GGUF writes by default
    (mha2mla/convert/plan/resolve.py), so a GGUF source and its conversion are timed in the same dtype rather than
    the float32 its dequantised weights would otherwise load in."""
    return torch.bfloat16 if dtype == "auto" else dtype


def _check_causal_lm_folder(folder: Path) -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = check_model_folder(folder)
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        not architectures or any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    )
    if not causal:
        what = f"a {model_type!r} model" if model_type else "a model without a model_type"
        arch = f" ({', '.join(architectures)})" if architectures else ""
        raise UserError(
            f"{folder} holds {what}{arch}, not a causal language model; eval needs a *ForCausalLM checkpoint."
        )
    return config


def check_model_spec(spec: str | Path) -> None:
    """Fail early (before any evaluation starts) on a path that can't be a causal LM, or a missing default model."""
    if str(spec) == "default":
        cached_default_model()
        return
    if source_kind(spec) == "folder":
        _check_causal_lm_folder(Path(spec).expanduser())


def load_model(spec: str | Path, dtype: str | torch.dtype = "auto", device: str | None = None) -> LoadedModel:
    """Load ``spec`` (folder, ``.gguf`` file, ``"default"`` for the default SmolLM2 GGUF, or a hub id when online)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.evaluation.tasks import is_offline

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    spec = str(spec)
    path = cached_default_model() if spec == "default" else Path(spec).expanduser()
    path = path.resolve() if path.exists() else path
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path} is a file but not a .gguf model; pass a model folder or a .gguf file.")
        from mha2mla.io.source import load_gguf_model

        kind, name = "gguf", path.stem
        model, tokenizer = load_gguf_model(path, gguf_dtype(torch_dtype))
    elif path.is_dir():
        config = _check_causal_lm_folder(path)
        kind, name = "folder", path.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (ValueError, OSError) as error:
            raise UserError(f"{path} has no usable tokenizer ({str(error).splitlines()[0][:200]}).") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype, attn_implementation=mla_attention_for(config)
            )
        except OSError as error:
            raise UserError(
                f"could not load the weights in {path} ({str(error).splitlines()[0][:200]})."
            ) from None
    else:
        source_kind(spec)  # not a hub id: one sentence
        if is_offline():
            raise UserError(
                f"{spec} is not a local path and this machine is offline, so it can't be fetched from the hub."
            )
        kind, name = "hub", spec.split("/")[-1]
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
    model.to(device).eval()
    log.info("loaded %s (%s, %s) on %s", name, kind, next(model.parameters()).dtype, device)
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, path=str(path if kind != "hub" else spec), kind=kind
    )
