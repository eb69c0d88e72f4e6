import os

import pytest

# The Triton interpreter must be chosen before any @triton.jit function is imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import logging
import sys
from pathlib import Path

import torch

torch.manual_seed(0)

from common import build_source, tiny_deepseek_config, tiny_tokenizer  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session")
def llama_source(tmp_path_factory):
    """A tiny random Llama source with GQA (4 query heads, 2 KV heads) and a tiny tokenizer. Shared: never modify it
    (a test that needs to change it copies it)."""
    return build_source(tmp_path_factory.mktemp("llama_source") / "llama", "llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="session")
def tiny_mla(tmp_path_factory):
    """A converted-looking tiny DeepSeek-V3 MLA folder (random weights, tiny tokenizer, conversion report, card), the
    input recover and its checks start from. Shared: never modify it."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_mla")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_deepseek_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "conversion_report.json").write_text(json.dumps({"kv_lora_rank": 24}) + "\n")
    (folder / "README.md").write_text("# tiny converted model\n")
    return folder


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted: capsys swaps it in only when the test body
    runs, after fixtures are set up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


@pytest.fixture
def stderr_logging():
    """Log records reach stderr as in the real CLI (pytest's own handlers would swallow them)."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """An empty MHA2MLA_CACHE inside the test's folder, so what the GGUF cache leaves is part of the snapshot."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MHA2MLA_CACHE", str(cache))
    return cache
