"""Resolve a SOURCE argument (local folder, .gguf file or hub id) into a local safetensors folder.

This module stays light (no torch) so that the CLI can check a SOURCE with :func:`check_source` before the heavy
libraries load; the reader and transformers are imported where a model is actually read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.cache import cache_dir
from mha2mla.io.model_folder import CONFIG_FILE, check_weights, read_config, source_kind
from mha2mla.io.output import remove_stale, staging_path, write_errors

try:
    import fcntl
except ImportError:  # not POSIX: no lock, a concurrent winner is still tolerated
    fcntl = None

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "README.md"]


def _gguf_cache_folder(gguf_path: Path, create: bool = True) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir(create) / "gguf" / f"{gguf_path.stem}-{key}"


def check_source(source: str | Path) -> None:
    """The SOURCE mistakes found without reading a model: a path that does not exist, a file that is not a .gguf,
    a folder whose weights do not read back (mha2mla/io/model_folder.py)."""
    if source_kind(source) == "folder" and (Path(source).expanduser() / CONFIG_FILE).is_file():
        check_weights(Path(source).expanduser())


def check_gguf_magic(path: Path) -> None:
    """A file named .gguf that does not start with the GGUF magic bytes (empty, random, another format) is one
    sentence before anything is read or cached."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise UserError(f"cannot read {path} ({error.strerror}).") from None
    if magic != b"GGUF":
        what = "is empty" if not magic else "does not start with the GGUF magic bytes"
        raise UserError(f"could not read {path} as a GGUF model (the file {what}); pass a .gguf model file.")


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


def gguf_config(gguf_path: str | Path) -> dict:
    """The config.json a dequantised copy of ``gguf_path`` holds: the cached copy's when a conversion made one, else
    built from the file's metadata alone -- transformers reads it with the gguf package's GGUFReader, which
    memory-maps the file, so no tensor is read or dequantised and nothing is cached."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    gguf_path = Path(gguf_path)
    check_gguf_magic(gguf_path)
    cached = _gguf_cache_folder(gguf_path, create=False) / CONFIG_FILE
    if cached.is_file():
        return read_config(cached.parent)
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).to_dict()
    except Exception as error:
        raise UserError(f"could not read {gguf_path} as a GGUF model ({_first_line(error)}).") from error
    # what save_pretrained of the dequantised model records: its class, and the float32 it is loaded in
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    config["architectures"] = config.get("architectures") or ([model_class] if model_class else None)
    config["dtype"] = "float32"
    return config


def _dequantising():
    """transformers' option that unpacks every GGUF weight into a plain dense tensor (what mha2mla reads and
    writes); without it, a bfloat16 load warns that packed weights compute fastest in float32. None in a
    transformers that always dequantises (before GgufConfig)."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return None
    return GgufConfig(dequantize=True)


@contextlib.contextmanager
def _dequantising_bar_follows_transformers() -> Iterator[None]:
    """transformers draws its "de-quantizing GGUF tensors" bar with tqdm itself; for the load it gets transformers'
    own tqdm, which honours ``transformers.utils.logging.disable_progress_bar()`` as the library's other bars do."""
    from transformers import modeling_gguf_pytorch_utils as module
    from transformers.utils import logging as transformers_logging

    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return
    module.tqdm = transformers_logging.tqdm
    try:
        yield
    finally:
        module.tqdm = original


def load_gguf_weights(gguf_path: str | Path, dtype=None, **model_kwargs):
    """The model of a .gguf file, loaded with transformers (dequantised) as a plain, unquantised model in ``dtype``
    (None: float32). ``model_kwargs`` go to ``from_pretrained`` (e.g. ``attn_implementation``)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    dequantise = _dequantising()
    if dequantise is not None:
        model_kwargs.setdefault("quantization_config", dequantise)
    try:
        with _dequantising_bar_follows_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype or torch.float32, **model_kwargs
            )
    except Exception as error:
        raise UserError(f"could not read {gguf_path} as a GGUF model ({_first_line(error)}).") from error
    # the weights are dequantised: forget the quantiser so save_pretrained writes plain tensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_gguf_tokenizer(gguf_path: str | Path):
    """The tokenizer a .gguf file carries in its metadata."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:
        raise UserError(f"could not read {gguf_path} as a GGUF model ({_first_line(error)}).") from error


def load_gguf_model(gguf_path: str | Path, dtype=None, **model_kwargs):
    """The model (:func:`load_gguf_weights`) and the tokenizer of a .gguf file."""
    return load_gguf_weights(gguf_path, dtype, **model_kwargs), load_gguf_tokenizer(gguf_path)


def _lock_file(path: Path):
    """``path`` opened and locked (waiting for a holder), or None where the file system has no locks. A holder
    removes the file when done, so a lock whose file is gone by the time it is granted is taken again."""
    while True:
        handle = open(path, "a")
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another mha2mla process that is filling %s", path.name.removesuffix(".lock"))
                fcntl.flock(handle, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: tolerate a concurrent winner
                handle.close()
                return None
            if _same_file(handle, path):
                return handle
        except BaseException:
            handle.close()
            raise
        handle.close()


def _same_file(handle, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _filling(target: Path) -> Iterator[None]:
    """Hold the lock that lets one process at a time fill cache entry ``target`` (the others wait, then find it);
    the lock file is removed when the holder is done, whether it filled the entry or failed."""
    if fcntl is None:
        yield
        return
    path = target.parent / f".{target.name}.lock"
    handle = _lock_file(path)
    try:
        yield
    finally:
        if handle is not None:
            if _same_file(handle, path):
                path.unlink(missing_ok=True)
            handle.close()


def _fill(gguf_path: Path, target: Path) -> None:
    """Dequantise ``gguf_path`` into a staging folder beside ``target`` and rename it; the staging folder never
    outlives a failure."""
    log.info("dequantising %s into %s", gguf_path.name, target)
    model, tokenizer = load_gguf_model(gguf_path)
    staging = staging_path(target)
    try:
        staging.mkdir()
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / CONFIG_FILE).exists():  # a concurrent winner where locks do not work is kept
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def gguf_to_folder(gguf_path: str | Path) -> Path:
    """Dequantise a .gguf file once into a cached Hugging Face safetensors folder and return it.

    Filled under a lock, in a staging folder named with the PID (mha2mla/io/output.py) that is renamed at the end;
    a killed run's staging folder is removed by the next one, and a concurrent process that won the race is kept.
    A failure (not a GGUF, a full disk) leaves no staging folder, no lock and no cache folder made for it."""
    gguf_path = Path(gguf_path)
    check_gguf_magic(gguf_path)
    target = _gguf_cache_folder(gguf_path)
    if (target / CONFIG_FILE).exists():
        return target
    made = not target.parent.exists()
    try:
        with write_errors(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            with _filling(target):
                remove_stale(target.parent)
                if not (target / CONFIG_FILE).exists():  # else filled while this process waited for the lock
                    _fill(gguf_path, target)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                target.parent.rmdir()  # only when empty: another process may be filling it
        raise
    return target


def hub_model_folder(repo_id: str) -> Path:
    """The hub model ``repo_id`` downloaded (or found) in the Hugging Face cache; offline, only a cached copy."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as error:
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{repo_id} is not a local path and the Hugging Face cache has no copy of it, which this "
                            "offline machine (HF_HUB_OFFLINE) cannot fetch; pass a model folder or a .gguf file.") from error
        raise UserError(
            f"{repo_id} is neither a local path nor a downloadable hub model ({type(error).__name__}); "
            "check the name, or download it and pass the folder."
        ) from error


def resolve_source(source: str | Path) -> Path:
    """A local folder holding config.json and safetensors weights for ``source``."""
    check_source(source)
    path = Path(source).expanduser()
    if path.is_file():
        return gguf_to_folder(path)
    if path.is_dir():
        return path
    return hub_model_folder(str(source))


def open_source(source: str | Path):
    """A :class:`~mha2mla.io.reader.LazyCheckpoint` of ``source``."""
    from mha2mla.io.reader import LazyCheckpoint  # torch: imported here so that check_source stays fast

    return LazyCheckpoint(resolve_source(source))
