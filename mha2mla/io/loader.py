"""Load a causal language model (or only its shapes, on the meta device), its tokenizer or its transformers config,
the one place that does: from a model
folder, a ``.gguf`` file (dequantised, mha2mla/io/source.py) or a hub id (downloaded into the Hugging Face cache
first), in one dtype and attention implementation. ``eval``, ``recover`` (its teacher and student), ``convert``'s
calibration and the tests load every model through here, so a folder that is not a causal LM, a damaged weight
file or an unloadable tokenizer gets the same sentence from each.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.io.model_folder import check_causal_lm_folder, source_kind
from mha2mla.io.source import hub_model_folder, load_gguf_tokenizer, load_gguf_weights
from mha2mla.kernels.sdpa import mla_attention_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_AUTO_DTYPE = torch.bfloat16  # what a conversion of a GGUF writes by default (mha2mla/convert/plan/resolve.py)


def resolve_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype:
    """``"auto"`` (None too: the checkpoint's own dtype), a torch dtype, or the name of one of DTYPES."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype or "auto"
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def gguf_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """The dtype a GGUF model loads in: ``auto`` is bfloat16, the dtype its conversion writes by default, so a GGUF
    source and its conversion compute in the same dtype rather than the float32 of its dequantised weights."""
    dtype = resolve_dtype(dtype)
    return GGUF_AUTO_DTYPE if dtype == "auto" else dtype


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


def load_config(folder: str | Path, *, hint: str = "point at a Hugging Face model folder"):
    """The transformers config (a ``PretrainedConfig``) that the config.json of the model folder ``folder``
    describes; one sentence ending in ``hint`` when transformers cannot build it (a model type it does not know)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read the model config in {folder} ({_first_line(error)}); {hint}.") from None


def meta_causal_lm(folder: str | Path):
    """The causal LM of the model folder ``folder`` (its config.json) on the meta device: its shapes, no memory."""
    from transformers import AutoModelForCausalLM

    config = load_config(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def model_path(spec: str | Path) -> tuple[str, Path]:
    """The kind of a model argument (``folder``, ``gguf`` or ``hub``) and the local path it loads from: the folder,
    the .gguf file, or the hub model's downloaded folder."""
    kind = source_kind(spec)
    return kind, hub_model_folder(str(spec)) if kind == "hub" else Path(spec).expanduser()


def load_causal_lm(spec: str | Path, dtype: str | torch.dtype | None = "auto", attention: str | None = None, *,
                   trust_remote_code: bool = False):
    """The causal LM of ``spec`` (a model folder, a ``.gguf`` file or a hub id) in ``dtype`` (a torch dtype, one of
    DTYPES' names, or ``"auto"``: the checkpoint's own, bfloat16 for a GGUF), with attention implementation
    ``attention`` (None: transformers' default). A converted MLA model whose value head is narrower than its
    query/key head runs ``sdpa`` and the default as ``mha2mla_sdpa`` (mha2mla/kernels/sdpa.py)."""
    from transformers import AutoModelForCausalLM

    folder_dtype, gguf_file_dtype = resolve_dtype(dtype), gguf_dtype(dtype)  # an unknown dtype refused first
    kind, path = model_path(spec)
    if kind == "gguf":
        kwargs = {} if attention is None else {"attn_implementation": attention}
        return load_gguf_weights(path, gguf_file_dtype, **kwargs)
    config = check_causal_lm_folder(path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=folder_dtype, attn_implementation=mla_attention_for(config, attention),
            trust_remote_code=trust_remote_code,
        )
    except OSError as error:
        raise UserError(f"could not load the weights in {path} ({_first_line(error)}).") from None


def load_tokenizer(spec: str | Path, *, hint: str = "pass the folder of a model with its tokenizer files",
                   trust_remote_code: bool = False):
    """The tokenizer of ``spec`` (a model folder, a ``.gguf`` file or a hub id); one that does not load is one
    sentence ending in ``hint``."""
    from transformers import AutoTokenizer

    kind, path = model_path(spec)
    if kind == "gguf":
        return load_gguf_tokenizer(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as error:  # a damaged tokenizer.json raises KeyError or the tokenizers library's bare Exception
        raise UserError(f"cannot load a tokenizer from {path} ({_first_line(error)}); {hint}.") from None
