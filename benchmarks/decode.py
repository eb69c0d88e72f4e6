"""Decode speed and KV-cache bytes: source model vs converted model (transformers) vs converted model (our engine).

    MHA2MLA_CACHE=.cache .venv/bin/python benchmarks/decode.py \
        --converted .cache/converted/smollm2-135m-kv0.125 --contexts 1024,4096,8192 --batches 1,8 --steps 8

In one run, for every context length and batch size:

(a) ``source``       the source model (SmolLM2-135M GGUF, dequantised) with transformers and its DynamicCache;
(b) ``hf-mla``       the converted checkpoint with transformers' DeepseekV3, which caches the latent but expands
                     it into per-head keys and values on every decode step;
(c) ``mla-engine``   the converted checkpoint with mha2mla.modeling.model (absorbed decode from the latent cache).

Each model prefills one prompt of ``context`` held-out tokens (KJV; timed separately), its cache is repeated to
the batch size (decode work does not depend on the cache's content, and this skips batch-times-larger
prefills on a small CPU), then ``--warmup`` untimed and ``--steps`` timed greedy decode steps run. (b)'s cache
is filled from (c)'s prefill by default — both hold the same normalised latent and rotated rope key, which the
first decode step checks (``hf_vs_engine_logits_max_diff``); ``--hf-own-prefill`` runs transformers' own
prefill instead. Decode tokens/s = batch / median step time; cache bytes are measured on the live cache
tensors after the last step (context + warmup + steps tokens). Prints JSON and a Markdown table.

Compute dtypes (docs/generate.md): ``--compute-dtypes float32 bfloat16`` runs the engine in both, side by side on
the same decode steps (each prefills in its own dtype; bfloat16 is fed float32's greedy tokens), and adds their
decode tokens/s ratio and how far bf16's logits move from float32's (max abs Δ logit, max abs Δ logprob of
float32's top-1 token, top-1 agreement), judged against transformers' own DeepseekV3 in bf16 on the same tokens
(the tolerance is stated in benchmarks/decode_dtypes.py; ``--no-transformers-reference`` skips it). The float32 vs
bfloat16 measurement of docs/benchmarks.md (a few minutes on an idle 2-core CPU, most of it the 4K-token prefills
and transformers' two reference forwards):

    MHA2MLA_CACHE=.cache .venv/bin/python benchmarks/decode.py \
        --converted .cache/converted/smollm2-135m-kv0.125 --models mla-engine --compute-dtypes float32 bfloat16 \
        --contexts 4096 --batches 1,8 --warmup 2 --steps 16 --threads 2 --json-out decode-dtypes.json

``--standin`` builds a random DeepSeek-V3 checkpoint with SmolLM2's shapes (30 layers, D 576, H 9, d_n 64,
d_v 64, d_r 16, r 32) when no converted model exists yet: for developing the benchmark only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_dtypes import dtype_comparisons, logits_agreement, time_engine_decode, transformers_agreement
from benchmarks.decode_dtypes import markdown as dtype_markdown
from mha2mla.modeling.model import MLAModel


def _dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def load_source(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer


def build_standin(folder: Path, kv_lora_rank: int = 32, rope_dim: int = 16, max_positions: int = 16384) -> Path:
    """A random DeepSeek-V3 MLA checkpoint with SmolLM2-135M's shapes (benchmark development only)."""
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


def _engine_name(dtype: str) -> str:
    return "mla-engine" if dtype == "float32" else f"mla-engine-{ {'bfloat16': 'bf16'}.get(dtype, dtype) }"


def _engines_at(engines: dict, context: int, batches: list[int], ids: list[int], args, rows, agreements,
                fed_tokens) -> dict:
    """Every compute dtype's engine at one context: its own prefill, then for each batch the decode steps, the
    first dtype choosing the greedy tokens and the others fed the same ones. Returns {dtype: (cache, first logits)}
    for the hf-mla handover."""
    capacity = context + args.warmup + args.steps
    prefilled = {}
    for dtype, engine in engines.items():
        cache = engine.new_cache(1, capacity)
        start = time.perf_counter()
        logits = engine.prefill(cache, [ids[:context]])
        prefilled[dtype] = (cache, logits, time.perf_counter() - start)
    for batch in batches:
        print(f"context {context}, batch {batch}: mla-engine {', '.join(engines)} ...", file=sys.stderr, flush=True)
        reference, forced = None, None
        first = next(iter(prefilled.values()))[1].argmax(-1).repeat(batch)  # (B,) the first dtype's greedy token
        for dtype, engine in engines.items():
            cache_1, first_logits, prefill_s = prefilled[dtype]
            cache = cache_1.repeat_rows(batch)
            times, logits, fed = time_engine_decode(engine, cache, first, args.warmup, args.steps, forced)
            rows.append(_entry(_engine_name(dtype), context, batch, prefill_s, times, cache.nbytes, capacity, dtype))
            logits = [first_logits.repeat(batch, 1)] + logits  # every position: the prompt's last, then each step
            if reference is None:
                reference, forced = logits, fed
                fed_tokens[context] = [int(t[0]) for t in fed]  # row 0, for transformers' reference
            else:
                agreements[(context, batch, dtype)] = logits_agreement(reference, logits)
            del cache
    return {dtype: value[:2] for dtype, value in prefilled.items()}


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from scripts.assets import default_model_gguf, held_out_token_ids

    torch.set_num_threads(args.threads)
    models = set(args.models.split(","))
    converted = Path(args.converted)
    standin = False
    if not (converted / "absorbed.json").exists():
        if not args.standin:
            raise SystemExit(f"{converted} has no converted model with absorbed weights; pass --standin to develop with a random one.")
        converted = build_standin(Path(tempfile.mkdtemp(prefix="mla-standin-")))
        standin = True

    source, tokenizer = load_source(Path(args.source) if args.source else default_model_gguf())
    source = source if "source" in models else None
    hf_mla = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval() if "hf-mla" in models else None
    engines = {dtype: MLAModel.from_pretrained(converted, device="cpu", dtype=getattr(torch, dtype))
               for dtype in args.compute_dtypes}  # the first one chooses the greedy tokens the others are fed
    config = next(iter(engines.values())).config

    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    all_ids = held_out_token_ids(tokenizer, "kjv", num_tokens=max(contexts))
    rows, checks, agreements, fed_tokens, references = [], [], {}, {}, {}
    for context in contexts:
        prompt = torch.tensor([all_ids[:context]])  # (1, T)
        tokens_in_cache = context + args.warmup + args.steps
        prefilled = _engines_at(engines, context, batches, all_ids, args, rows, agreements, fed_tokens)
        if len(engines) > 1 and not args.no_transformers_reference:
            print(f"context {context}: transformers float32 and bfloat16 (the bf16 bar) ...", file=sys.stderr, flush=True)
            references[context] = transformers_agreement(converted, all_ids[:context], fed_tokens[context])
        handover_dtype = "float32" if "float32" in prefilled else next(iter(prefilled))
        engine_cache, engine_logits = prefilled[handover_dtype]
        engine_first = engine_logits.argmax(-1)
        if source is not None:  # (a) transformers prefill once, cache repeated per batch
            with torch.inference_mode():
                start = time.perf_counter()
                out = source(prompt, use_cache=True)
                source_prefill = time.perf_counter() - start
            for batch in batches:
                print(f"context {context}, batch {batch}: source ...", file=sys.stderr, flush=True)
                cache = _copy_dynamic(out.cache, batch)
                times, _ = _time_hf_decode(source, cache, out.logits[:, -1].argmax(-1, keepdim=True).repeat(batch, 1),
                                           args.warmup, args.steps)
                rows.append(_entry("source", context, batch, source_prefill, times, _dynamic_cache_bytes(cache), tokens_in_cache))
            del out, cache
        if hf_mla is not None:  # (b) transformers' DeepseekV3: own prefill, or the engine's latent cache handed over
            hf_prefill = None
            if args.hf_own_prefill:
                with torch.inference_mode():
                    start = time.perf_counter()
                    hf_cache_1 = hf_mla(prompt, use_cache=True).cache
                    hf_prefill = time.perf_counter() - start
            else:
                hf_cache_1 = _hf_cache_from_latent(engine_cache, config)
            for batch in batches:
                print(f"context {context}, batch {batch}: hf-mla ...", file=sys.stderr, flush=True)
                cache = _copy_dynamic(hf_cache_1, batch)
                times, hf_logits = _time_hf_decode(hf_mla, cache, engine_first.repeat(batch)[:, None], args.warmup, args.steps)
                rows.append(_entry("hf-mla", context, batch, hf_prefill, times, _dynamic_cache_bytes(cache), tokens_in_cache))
                engine_cache_b = engine_cache.repeat_rows(batch)  # the engine's logits on the same steps
                _, ours, _ = time_engine_decode(engines[handover_dtype], engine_cache_b, engine_first.repeat(batch),
                                                args.warmup, args.steps)
                checks.append({"context": context, "batch": batch, "engine_dtype": handover_dtype,
                               "hf_vs_engine_logits_max_diff": float((hf_logits - ours[-1]).abs().max())})
                del cache, engine_cache_b

    by_key = {(r["model"], r["context"], r["batch"]): r for r in rows}
    for row in rows:
        for other, key in (("source", "tokens_per_s_vs_source"), ("hf-mla", "tokens_per_s_vs_hf_mla")):
            base = by_key.get((other, row["context"], row["batch"]))
            row[key] = None if base is None else round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        base = by_key.get(("source", row["context"], row["batch"]))
        row["cache_bytes_vs_source"] = None if base is None else round(row["cache_bytes"] / base["cache_bytes"], 4)
    return {
        "converted": str(converted) if not standin else "random stand-in (SmolLM2 shapes, r=32, d_r=16)",
        "standin": standin,
        "kv_lora_rank": config.kv_lora_rank,
        "rope_dim": config.qk_rope_head_dim,
        "compute_dtypes": list(args.compute_dtypes),
        "threads": args.threads,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "results": rows,
        "checks": checks,
        "compute_dtype_comparison": dtype_comparisons(rows, agreements, references),
    }


def _copy_dynamic(cache, batch: int):
    """A deep copy of a transformers DynamicCache with every row repeated ``batch`` times."""
    from transformers import DynamicCache

    copy = DynamicCache()
    for index, layer in enumerate(cache.layers):
        copy.update(layer.keys.repeat_interleave(batch, dim=0), layer.values.repeat_interleave(batch, dim=0), index)
    return copy


def markdown(report: dict) -> str:
    def ratio(value, fmt):
        return "" if value is None else format(value, fmt)

    lines = [
        "| context | batch | model | prefill s | decode tok/s | × source | × hf-mla | cache MiB | cache / source |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        prefill = "" if r["prefill_s"] is None else f"{r['prefill_s']:.1f}"
        share = "" if r["cache_bytes_vs_source"] is None else f"{100 * r['cache_bytes_vs_source']:.1f}%"
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['model']} | {prefill} | {r['decode_tokens_per_s']:.2f} | "
            f"{ratio(r['tokens_per_s_vs_source'], '.2f')} | {ratio(r['tokens_per_s_vs_hf_mla'], '.2f')} | "
            f"{r['cache_bytes'] / 2**20:.1f} | {share} |"
        )
    if report["compute_dtype_comparison"]:
        lines += ["", dtype_markdown(report["compute_dtype_comparison"])]
    return "\n".join(lines)


def main() -> None:
    cache_root = os.environ.get("MHA2MLA_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", default=str(Path(cache_root) / "converted" / "smollm2-135m-kv0.125"))
    parser.add_argument("--source", default=None, help="source GGUF file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed decode steps first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="source,hf-mla,mla-engine",
                        help="comma-separated: source, hf-mla, mla-engine (the engine always runs: the others need it)")
    parser.add_argument("--compute-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="the engine's compute dtypes, side by side on the same steps (the first chooses the tokens)")
    parser.add_argument("--no-transformers-reference", action="store_true",
                        help="skip transformers' float32 and bf16 forwards that set the bf16 tolerance")
    parser.add_argument("--hf-own-prefill", action="store_true", help="let transformers' DeepseekV3 run its own prefill")
    parser.add_argument("--standin", action="store_true", help="use a random SmolLM2-shaped MLA model if none is converted")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    print()
    print(markdown(report))
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
