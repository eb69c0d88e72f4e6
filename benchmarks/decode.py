"""Decode speed and KV-cache bytes: source model vs converted model (transformers) vs converted model (our engine).

    OMP_NUM_THREADS=2 python benchmarks/decode.py --converted .cache/converted/smollm2-135m-kv0.125 \
        --contexts 1024,4096,8192 --batches 1,8 --steps 8

In one run, for every context length and batch size:

(a) ``source``       the source model (default: the cached SmolLM2-135M GGUF, dequantised) with transformers and
                     its DynamicCache;
(b) ``hf-mla``       the converted checkpoint with transformers' DeepseekV3, which caches the latent but expands
                     it into per-head keys and values on every decode step;
(c) ``mla-engine``   the converted checkpoint with mha2mla.modeling.model (absorbed decode from the latent cache),
                     in ``--compute-dtype`` (float32 by default; bfloat16 as ``mha2mla generate`` runs it).

Each model prefills one prompt of ``context`` held-out tokens (KJV; timed separately), its cache is repeated to
the batch size (decode work does not depend on the cache's content, and this skips batch-times-larger
prefills on a small CPU), then ``--warmup`` untimed and ``--steps`` timed greedy decode steps run.
(b)'s cache is filled from (c)'s prefill by default -- both hold the same normalised latent and rotated rope
key, which the first decode step checks (``hf_vs_engine_logits_max_diff``); ``--hf-own-prefill`` runs
transformers' own prefill instead. Decode tokens/s = batch / median step time; cache bytes are measured on the live
cache tensors after the last step (context + warmup + steps tokens). Prints the JSON record (benchmarks/harness.py)
and a Markdown table.

``--standin`` builds a random DeepSeek-V3 checkpoint with SmolLM2's shapes (30 layers, D 576, H 9, d_n 64,
d_v 64, d_r 16, r 32) when no converted model exists yet: for developing the benchmark only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import harness

if TYPE_CHECKING:
    import torch


def _dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def build_standin(folder: Path, kv_lora_rank: int = 32, rope_dim: int = 16, max_positions: int = 16384) -> Path:
    """A random DeepSeek-V3 MLA checkpoint with SmolLM2-135M's shapes (benchmark development only)."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from mha2mla.modeling.absorbed import write_absorbed

    config = DeepseekV3Config(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=9, kv_lora_rank=kv_lora_rank, q_lora_rank=None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=30,
        n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1, num_nextn_predict_layers=0,
        rope_interleave=True, max_position_embeddings=max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    write_absorbed(folder, model.state_dict(), config)
    return folder


def _time_hf_decode(model, cache, first_token: torch.Tensor, warmup: int, steps: int):
    """Greedy decode with a transformers model and its cache; returns (per-step seconds, last logits)."""
    import torch

    tokens = first_token  # (B, 1)
    times, logits = [], None
    with torch.inference_mode():
        for step in range(warmup + steps):
            start = time.perf_counter()
            logits = model(tokens, cache=cache, use_cache=True).logits[:, -1].float()  # (B, V)
            tokens = logits.argmax(-1, keepdim=True)
            elapsed = time.perf_counter() - start
            if step >= warmup:
                times.append(elapsed)
    return times, logits


def _hf_cache_from_latent(latent_cache, config):
    """A transformers DynamicCache holding exactly what DeepseekV3 would cache: keys = normalised latent
    (B, 1, T, r), values = rotated rope key (B, 1, T, d_r)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    tokens = latent_cache.max_length
    r = latent_cache.kv_lora_rank
    for layer in range(latent_cache.num_layers):
        stored = latent_cache.layer(layer)[:, :tokens]  # (B, T, r + d_r)
        cache.update(stored[..., :r].unsqueeze(1).float(), stored[..., r:].unsqueeze(1).float(), layer)
    return cache


def _entry(name, context, batch, prefill_s, times, cache_bytes, tokens_in_cache, compute_dtype=None):
    step = statistics.median(times)
    return {
        "model": name,
        "compute_dtype": compute_dtype,
        "context": context,
        "batch": batch,
        "prefill_s": None if prefill_s is None else round(prefill_s, 3),
        "decode_step_s_median": round(step, 5),
        "decode_tokens_per_s": round(batch / step, 3),
        "cache_bytes": cache_bytes,
        "cache_bytes_per_token_per_row": cache_bytes // (batch * tokens_in_cache),
    }


def _time_engine_decode(engine, cache, first_token: torch.Tensor, warmup: int, steps: int):
    """Greedy decode steps with the latent-cache model -> (per-step seconds of the timed steps, last logits (B, V))."""
    tokens, times, logits = first_token, [], None
    for step in range(warmup + steps):
        start = time.perf_counter()
        logits = engine.decode(cache, tokens)
        tokens = logits.argmax(-1)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
    return times, logits.float().cpu()


def _load_models(args, converted: Path, models: set[str]):
    """(source model or None, its tokenizer, transformers' DeepseekV3 or None, our engine)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.modeling.model import MLAModel

    source_folder = harness.source_model(args.source)
    tokenizer = AutoTokenizer.from_pretrained(source_folder)
    source = AutoModelForCausalLM.from_pretrained(source_folder, dtype=torch.float32).eval() if "source" in models else None
    hf_mla = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval() if "hf-mla" in models else None
    engine = MLAModel.from_pretrained(converted, device="cpu", dtype=getattr(torch, args.compute_dtype))
    return source, tokenizer, hf_mla, engine


def _source_rows(source, prompt, batches, args, tokens_in_cache, rows) -> None:
    """(a): transformers prefills once, its cache repeated per batch."""
    import torch

    context = prompt.shape[1]
    with torch.inference_mode():
        start = time.perf_counter()
        out = source(prompt, use_cache=True)
        prefill = time.perf_counter() - start
    for batch in batches:
        print(f"context {context}, batch {batch}: source ...", file=sys.stderr, flush=True)
        cache = _copy_dynamic(out.cache, batch)
        first = out.logits[:, -1].argmax(-1, keepdim=True).repeat(batch, 1)
        times, _ = _time_hf_decode(source, cache, first, args.warmup, args.steps)
        rows.append(_entry("source", context, batch, prefill, times, _dynamic_cache_bytes(cache), tokens_in_cache))


def _mla_rows(engine, hf_mla, prompt, batches, args, tokens_in_cache, rows, checks) -> None:
    """(c) our engine, then (b) transformers' DeepseekV3 on its own prefill or on the engine's latent cache."""
    import torch

    context = prompt.shape[1]
    engine_cache = engine.new_cache(1, tokens_in_cache)
    start = time.perf_counter()
    first = engine.prefill(engine_cache, [prompt[0].tolist()]).argmax(-1)  # (1,)
    engine_prefill = time.perf_counter() - start
    hf_cache, hf_prefill = None, None
    if hf_mla is not None and args.hf_own_prefill:
        with torch.inference_mode():
            start = time.perf_counter()
            hf_cache = hf_mla(prompt, use_cache=True).cache
            hf_prefill = time.perf_counter() - start
    elif hf_mla is not None:
        hf_cache = _hf_cache_from_latent(engine_cache, engine.config)
    for batch in batches:
        print(f"context {context}, batch {batch}: mla-engine ...", file=sys.stderr, flush=True)
        cache = engine_cache.repeat_rows(batch)
        times, ours = _time_engine_decode(engine, cache, first.repeat(batch), args.warmup, args.steps)
        rows.append(_entry("mla-engine", context, batch, engine_prefill, times, cache.nbytes, tokens_in_cache,
                           args.compute_dtype))
        if hf_cache is None:
            continue
        print(f"context {context}, batch {batch}: hf-mla ...", file=sys.stderr, flush=True)
        cache = _copy_dynamic(hf_cache, batch)
        times, theirs = _time_hf_decode(hf_mla, cache, first.repeat(batch)[:, None], args.warmup, args.steps)
        rows.append(_entry("hf-mla", context, batch, hf_prefill, times, _dynamic_cache_bytes(cache), tokens_in_cache))
        checks.append({"context": context, "batch": batch, "engine_dtype": args.compute_dtype,
                       "hf_vs_engine_logits_max_diff": float((theirs - ours).abs().max())})


def _ratios(rows: list[dict]) -> None:
    """Each row's decode speed against the source's and transformers' MLA's, and its cache against the source's."""
    by_key = {(r["model"], r["context"], r["batch"]): r for r in rows}
    for row in rows:
        for other, key in (("source", "tokens_per_s_vs_source"), ("hf-mla", "tokens_per_s_vs_hf_mla")):
            base = by_key.get((other, row["context"], row["batch"]))
            row[key] = None if base is None else round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        base = by_key.get(("source", row["context"], row["batch"]))
        row["cache_bytes_vs_source"] = None if base is None else round(row["cache_bytes"] / base["cache_bytes"], 4)


def run(args) -> tuple[dict, list[dict], list[dict]]:
    """(settings, one row per model/context/batch, the hf-mla vs engine logit checks)."""
    import torch

    torch.set_num_threads(args.threads)
    models = set(args.models.split(","))
    converted = Path(args.converted)
    standin = not (converted / "absorbed.json").exists()
    if standin and not args.standin:
        raise SystemExit(f"{converted} has no converted model with absorbed weights; convert one (`mha2mla convert`) "
                         "or pass --standin to develop with a random one.")
    if standin:
        converted = build_standin(Path(tempfile.mkdtemp(prefix="mla-standin-")))
    source, tokenizer, hf_mla, engine = _load_models(args, converted, models)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    ids = harness.held_out_ids(tokenizer, "kjv", max(contexts))
    rows, checks = [], []
    for context in contexts:
        prompt = torch.tensor([ids[:context]])  # (1, T)
        tokens_in_cache = context + args.warmup + args.steps
        _mla_rows(engine, hf_mla, prompt, batches, args, tokens_in_cache, rows, checks)
        if source is not None:
            _source_rows(source, prompt, batches, args, tokens_in_cache, rows)
    _ratios(rows)
    settings = {"converted": "random stand-in (SmolLM2 shapes, r=32, d_r=16)" if standin else str(converted),
                "kv_lora_rank": engine.config.kv_lora_rank, "rope_dim": engine.config.qk_rope_head_dim,
                "compute_dtype": args.compute_dtype, "threads": args.threads, "warmup_steps": args.warmup,
                "timed_steps": args.steps}
    return settings, rows, checks


def _copy_dynamic(cache, batch: int):
    """A deep copy of a transformers DynamicCache with every row repeated ``batch`` times."""
    from transformers import DynamicCache

    copy = DynamicCache()
    for index, layer in enumerate(cache.layers):
        copy.update(layer.keys.repeat_interleave(batch, dim=0), layer.values.repeat_interleave(batch, dim=0), index)
    return copy


def markdown(rows: list[dict]) -> str:
    def ratio(value, fmt):
        return "" if value is None else format(value, fmt)

    lines = [
        "| context | batch | model | prefill s | decode tok/s | × source | × hf-mla | cache MiB | cache / source |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        prefill = "" if r["prefill_s"] is None else f"{r['prefill_s']:.1f}"
        share = "" if r["cache_bytes_vs_source"] is None else f"{100 * r['cache_bytes_vs_source']:.1f}%"
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['model']} | {prefill} | {r['decode_tokens_per_s']:.2f} | "
            f"{ratio(r['tokens_per_s_vs_source'], '.2f')} | {ratio(r['tokens_per_s_vs_hf_mla'], '.2f')} | "
            f"{r['cache_bytes'] / 2**20:.1f} | {share} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", default=None,
                        help="converted model folder (default: the cache's converted/smollm2-135m-kv0.125)")
    parser.add_argument("--source", default=None, help="source folder or .gguf (default: the cached SmolLM2-135M)")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed decode steps first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="source,hf-mla,mla-engine",
                        help="comma-separated: source, hf-mla, mla-engine (the engine always runs: the others need it)")
    parser.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's compute dtype")
    parser.add_argument("--hf-own-prefill", action="store_true", help="let transformers' DeepseekV3 run its own prefill")
    parser.add_argument("--standin", action="store_true", help="use a random SmolLM2-shaped MLA model if none is converted")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.converted = args.converted or str(harness.cache_path("converted", "smollm2-135m-kv0.125"))
    settings, rows, checks = run(args)
    harness.report("decode", settings, rows, args.json_out, table=markdown(rows), checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
