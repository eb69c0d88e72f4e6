"""Load what ``mha2mla eval`` evaluates: a local Hugging Face folder, a ``.gguf`` file, or a hub id when online.

Every path ends in a causal LM on one device in eval mode plus its tokenizer, so a model loaded here and
one passed in from memory go through exactly the same evaluation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2mla.devices import resolve_device
from mha2mla.io.cache import cached_default_model
from mha2mla.io.loader import check_causal_lm_folder, load_causal_lm, load_tokenizer
from mha2mla.io.model_folder import source_kind

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # a short label for tables and plots
    path: str  # what the user passed, resolved
    kind: str  # "folder" | "gguf" | "hub"


def check_model_spec(spec: str | Path) -> None:
    """Fail early (before any evaluation starts) on a path that can't be a causal LM, or a missing default model."""
    if str(spec) == "default":
        cached_default_model()
        return
    if source_kind(spec) == "folder":
        check_causal_lm_folder(Path(spec).expanduser())


def load_model(spec: str | Path, dtype: str | torch.dtype = "auto", device: str | None = None) -> LoadedModel:
    """Load ``spec`` (folder, ``.gguf`` file, ``"default"`` for the default SmolLM2 GGUF, or a hub id when online)
    with its tokenizer (mha2mla/io/loader.py), on ``device`` in eval mode."""
    device = resolve_device(device)
    spec = str(spec)
    path = cached_default_model() if spec == "default" else Path(spec).expanduser()
    path = path.resolve() if path.exists() else path
    kind = source_kind(path if path.exists() else spec)
    name = {"gguf": path.stem, "folder": path.name}.get(kind, spec.split("/")[-1])
    target = spec if kind == "hub" else path
    tokenizer = load_tokenizer(target)
    model = load_causal_lm(target, dtype)
    model.to(device).eval()
    log.info("loaded %s (%s, %s) on %s", name, kind, next(model.parameters()).dtype, device)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=str(target), kind=kind)
