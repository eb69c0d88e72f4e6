"""Resolve a SOURCE argument (local folder, .gguf file or hub id) into a local safetensors folder."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.reader import LazyCheckpoint

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def _gguf_cache_folder(gguf_path: Path) -> Path:
    from mha2mla.io.cache import cache_dir

    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def load_gguf_model(gguf_path: str | Path, dtype=None, **model_kwargs):
    """Load a .gguf file with transformers (dequantised) as a plain, unquantised model and its tokenizer.
    ``model_kwargs`` go to ``from_pretrained`` (e.g. ``attn_implementation``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype or torch.float32, **model_kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:
        raise UserError(f"could not read {gguf_path} as a GGUF model ({str(error).splitlines()[0]}).") from error
    # the weights are dequantised: forget the quantiser so save_pretrained writes plain tensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def gguf_to_folder(gguf_path: str | Path) -> Path:
    """Dequantise a .gguf file once into a cached Hugging Face safetensors folder and return it."""
    gguf_path = Path(gguf_path)
    target = _gguf_cache_folder(gguf_path)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("dequantising %s into %s", gguf_path.name, target)
    model, tokenizer = load_gguf_model(gguf_path)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as error:
        raise UserError(
            f"{repo_id} is neither a local path nor a downloadable hub model ({type(error).__name__}); "
            "check the name, or download it and pass the folder."
        ) from error


def resolve_source(source: str | Path) -> Path:
    """A local folder holding config.json and safetensors weights for ``source``."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return gguf_to_folder(path)
        raise UserError(f"{path} is a file but not a .gguf; pass a model folder, a .gguf file or a hub id.")
    if path.is_dir():
        return path
    text = str(source)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return _download(text)
    raise UserError(f"{source} does not exist; pass a model folder, a .gguf file or a hub id.")


def open_source(source: str | Path) -> LazyCheckpoint:
    return LazyCheckpoint(resolve_source(source))
