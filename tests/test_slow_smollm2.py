"""Real-model checks on SmolLM2-135M-Instruct (the default model): `make test-slow`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.output.portable import check_portable_folder
from mha2mla.convert.pipeline import convert
from mha2mla.data.held_out import held_out_token_ids
from mha2mla.evaluation.perplexity import window_perplexity
from mha2mla.io.cache import cached_default_model, cached_held_out_text  # `make test-slow` fetches them first
from mha2mla.io.source import resolve_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source():
    return resolve_source(cached_default_model())


def perplexity(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return window_perplexity(model, ids)


def test_calibrated_portable_conversion_of_smollm2_keeps_perplexity_within_2_4x(source, tmp_path):
    """31.25% KV, calibrated, portable (the default methods). Earlier defaults, before reconstruction, measured ×2.02
    on these 2,048 KJV tokens (without the refit ×2.22; the PCA default ×3.2). Breaking the stabiliser channel, the rope
    split or the latent shows up as ×100 or more; losing the attention-aware fit, as ×3 or more."""
    out = tmp_path / "mla"
    result = convert(source, out, ConvertConfig(kv_budget=0.3125, calib="default"), progress=False)
    assert result.plan.kv_lora_rank + result.plan.rope_dim == 120
    assert result.plan.extra_channel == "stabilizer"
    assert check_portable_folder(out) == []
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = held_out_token_ids(tokenizer, cached_held_out_text("kjv"), 2048)
    ratio = perplexity(out, ids) / perplexity(source, ids)
    assert ratio < 2.4, ratio
