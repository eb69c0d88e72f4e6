"""Reading a converted MLA model folder for the latent-cache model (mha2mla/modeling/model.py, docs/generate.md):
its config.json as a transformers config, the absorbed inference weights (``absorbed.json`` and
``absorbed.safetensors``, whose format mha2mla/modeling/absorbed.py writes) and a lazy reader of its checkpoint.

The files are opened here and only here, so the model computes on what io/ read; the checks of what the model can
compute (mha2mla/modeling/weights.py) stay with the model and run on what this returns. A damaged absorbed file is
one sentence naming the file and the command that writes it again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mha2mla import UserError
from mha2mla.io.loader import load_config
from mha2mla.io.model_folder import ABSORBED_FILE, ABSORBED_INDEX, check_model_folder
from mha2mla.io.reader import LazyCheckpoint

FORMAT_NAME = "mha2mla-absorbed"
FORMAT_VERSION = 1
# the shape keys generate compares with config.json (mha2mla.modeling.weights.check_absorbed_index)
INDEX_SIZES = ("num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
FOLDER_HINT = "point at a folder written by `mha2mla convert`"


@dataclass
class MLACheckpoint:
    """Everything the latent-cache model reads from a converted folder: the transformers config, the absorbed
    index and factors (``layers.{i}.w_uk`` and ``layers.{i}.w_uv``), and the reader of the other tensors, which
    reads them one at a time as the model asks for them."""

    config: object  # a transformers PretrainedConfig (a DeepseekV3Config once the model's checks pass)
    absorbed_index: dict
    absorbed: dict[str, torch.Tensor]
    reader: LazyCheckpoint


def read_mla_checkpoint(folder: str | Path, check_config: Callable[[object], None] | None = None) -> MLACheckpoint:
    """The converted checkpoint in ``folder``, its weight files checked to read back first. ``check_config`` (the
    model's rules on the config) runs before the absorbed weights are read, so a folder of another model is refused
    for what it is rather than for lacking absorbed weights."""
    folder = Path(folder)
    check_model_folder(folder, hint=FOLDER_HINT)
    config = load_config(folder, hint=FOLDER_HINT)
    if check_config is not None:
        check_config(config)
    index, absorbed = load_absorbed(folder)
    return MLACheckpoint(config, index, absorbed, LazyCheckpoint(folder))


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"{path} is damaged ({why}); re-run the `mha2mla convert` (or `mha2mla recover`) that wrote "
                     f"{path.parent} to write it again.")


def read_absorbed_index(path: Path) -> dict:
    """``absorbed.json`` as a dict holding the format name and every size of INDEX_SIZES as a positive whole number;
    one sentence naming the file otherwise."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _damaged(path, "not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise _damaged(path, f"not valid JSON: {error.msg} at line {error.lineno}") from None
    except OSError as error:
        raise UserError(f"cannot read {path} ({error.strerror}).") from None
    if not isinstance(index, dict):
        raise _damaged(path, f"a JSON {type(index).__name__}, not an object")
    if index.get("format") != FORMAT_NAME:
        raise _damaged(path, f"its format is {index.get('format')!r}, not {FORMAT_NAME!r}")
    for key in INDEX_SIZES:
        value = index.get(key)
        if value is None:
            raise _damaged(path, f"it lacks {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _damaged(path, f"{key} is {value!r}, not a positive whole number")
    return index


def load_absorbed(folder: str | Path, device: str | torch.device = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``absorbed.json`` and ``absorbed.safetensors`` from a converted model folder: the index checked, and a
    ``w_uk`` and ``w_uv`` for each of its layers, on ``device``."""
    folder = Path(folder)
    if not (folder / ABSORBED_INDEX).exists() or not (folder / ABSORBED_FILE).exists():
        raise UserError(f"{folder} has no absorbed weights ({ABSORBED_FILE}); convert it with `mha2mla convert`.")
    index = read_absorbed_index(folder / ABSORBED_INDEX)
    try:
        tensors = load_file(str(folder / ABSORBED_FILE), device=str(device))
    except SafetensorError as error:
        raise _damaged(folder / ABSORBED_FILE, " ".join(str(error).split())) from None
    for layer in range(index["num_hidden_layers"]):
        missing = [f"layers.{layer}.{name}" for name in ("w_uk", "w_uv") if f"layers.{layer}.{name}" not in tensors]
        if missing:
            raise _damaged(folder / ABSORBED_FILE, f"it lacks {missing[0]}")
    return index, tensors
