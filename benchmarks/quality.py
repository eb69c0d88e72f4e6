"""Training-free conversion quality: held-out perplexity of converted models, per KV budget and method.

    OMP_NUM_THREADS=1 MHA2MLA_CACHE=.cache python benchmarks/quality.py \\
        --budgets 0.3125 0.1875 0.125 --methods weight-svd act-pca act-attention-seq act-attention-refit --profiles exact

For each budget, method and profile it converts the model (default: SmolLM2-135M-Instruct from the
cached GGUF), loads the result with transformers and scores the held-out KJV and Python-docs slices
(``mha2mla.evaluation.perplexity``: 16,384 tokens from a third of the way in, 32 × 512 windows; never
used for calibration — calibration reads the bundled sample). It prints one JSON object per
conversion, then a JSON summary and a Markdown table with the ratio to the source model.
``--rope-dims`` sweeps the rope/rank split at each budget (default: the plan's split).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# name -> ConvertOptions fields (calib is added from --calib when a method is calibrated)
METHODS: dict[str, dict] = {
    "weight-svd": {"rope_mixing": "weight", "lowrank": "svd", "rope_compensation": "none", "norm_calibration": "rms"},
    "weight-score": {"rope_mixing": "weight", "lowrank": "score", "rope_compensation": "none", "norm_calibration": "rms"},
    "act-pca": {"calib": True, "calib_sequential": False, "rope_mixing": "activation", "lowrank": "pca", "rope_compensation": "none", "refit": "none"},
    "act-whiten": {"calib": True, "calib_sequential": False, "rope_mixing": "activation", "lowrank": "whiten", "rope_compensation": "none", "refit": "none"},
    "act-pca-seq": {"calib": True, "calib_sequential": True, "rope_mixing": "activation", "lowrank": "pca", "rope_compensation": "none", "refit": "none"},
    "score": {"calib": True, "calib_sequential": False, "rope_mixing": "query", "lowrank": "score", "rope_compensation": "none", "refit": "none"},
    "score-seq": {"calib": True, "calib_sequential": True, "rope_mixing": "query", "lowrank": "score", "rope_compensation": "none", "refit": "none"},
    "act-score-seq": {"calib": True, "calib_sequential": True, "rope_mixing": "activation", "lowrank": "score", "rope_compensation": "none", "refit": "none"},
    # dropped rotations replaced by their attention-weighted mean (attention.compensate_dropped_rotations)
    "act-pca-mean": {"calib": True, "calib_sequential": False, "rope_mixing": "activation", "lowrank": "pca", "rope_compensation": "mean", "refit": "none"},
    # + the attention-aware latent and per-head up-projections (lowrank.attention_aware_low_rank)
    "act-attention": {"calib": True, "calib_sequential": False, "rope_mixing": "activation", "lowrank": "attention", "rope_compensation": "mean", "refit": "none"},
    "act-attention-seq": {"calib": True, "calib_sequential": True, "rope_mixing": "activation", "lowrank": "attention", "rope_compensation": "mean", "refit": "none"},
    # + the read-out refitted on the converted layer towards the source stream (calibration.refit_attention)
    "act-attention-seq-values": {"calib": True, "calib_sequential": True, "rope_mixing": "activation", "lowrank": "attention",
                                 "rope_compensation": "mean", "refit": "values"},
    "act-attention-refit": {"calib": True, "calib_sequential": True, "rope_mixing": "activation", "lowrank": "attention",
                            "rope_compensation": "mean", "refit": "output"},  # the calibrated default
}
SLICES = ("kjv", "python_docs")


def evaluate(folder: Path, slices, num_tokens: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.evaluation.perplexity import held_out_perplexity

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return {name: held_out_perplexity(model, tokenizer, name, num_tokens=num_tokens) for name in slices}


_STATISTICS: dict = {}


def source_statistics(source: Path, options) -> list:
    """Every layer's statistics on the source model's own activations, computed once per calibration set."""
    from mha2mla.convert.calibration import calibration_statistics
    from mha2mla.convert.plan import make_plan
    from mha2mla.families import family_for_config
    from mha2mla.io.source import open_source

    key = (str(source), options.calib, options.calib_samples, options.calib_seq_len)
    if key not in _STATISTICS:
        ckpt = open_source(source)
        family = family_for_config(ckpt.config)
        provider = calibration_statistics(ckpt, family, make_plan(ckpt.config, family, options), options, progress=False)
        _STATISTICS[key] = [provider(layer) for layer in range(provider.num_layers)]
    return _STATISTICS[key]


def method_options(method: str, args) -> dict:
    spec = dict(METHODS[method])
    if spec.pop("calib", False):
        spec.update(calib=args.calib, calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len)
    return spec


def run_one(source: Path, budget: float, rope_dim: int | None, method: str, profile: str, args) -> dict:
    from mha2mla.convert.options import ConvertOptions
    from mha2mla.convert.pipeline import convert
    from mha2mla.convert.plan import make_plan
    from mha2mla.families import family_for_config
    from mha2mla.io.source import open_source

    options = dict(profile=profile, kv_budget=budget, **method_options(method, args))
    if args.norm_calibration != "auto":
        options["norm_calibration"] = args.norm_calibration
    if rope_dim is not None:  # same total cache as the budget, another rope/rank split
        ckpt = open_source(source)
        plan = make_plan(ckpt.config, family_for_config(ckpt.config), ConvertOptions(profile=profile, kv_budget=budget))
        options.update(kv_budget=None, rope_dim=rope_dim, kv_lora_rank=plan.kv_lora_rank + plan.rope_dim - rope_dim)
    if args.full_rank:  # no low-rank loss: only the rope cut (at the rope dim given) remains
        ckpt = open_source(source)
        plan = make_plan(ckpt.config, family_for_config(ckpt.config), ConvertOptions(profile=profile, kv_budget=budget))
        full = 2 * plan.shape.num_kv_heads * plan.shape.head_dim + plan.kv_lora_rank - plan.latent_rank
        options.update(kv_budget=None, rope_dim=rope_dim or plan.rope_dim, kv_lora_rank=full)
    options = ConvertOptions(**options)
    statistics = None
    if options.calib is not None and not options.calib_sequential:
        statistics = source_statistics(source, options).__getitem__  # the same for every method and budget
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        started = time.time()
        result = convert(source, Path(tmp) / "out", options, progress=False, statistics=statistics,
                         command="benchmarks/quality.py")
        seconds = time.time() - started
        perplexity = evaluate(Path(tmp) / "out", args.slices, args.windows * 512)
    layers = result.report["layers"]
    return {
        "budget": budget, "method": method, "profile": profile,
        "rope_dim": result.plan.rope_dim, "kv_lora_rank": result.plan.kv_lora_rank,
        "values_per_token_per_layer": result.plan.rope_dim + result.plan.kv_lora_rank,
        "methods": result.report["methods"], "convert_seconds": round(seconds, 1),
        "statistics": "precomputed (source activations)" if statistics is not None else "in convert",
        "k_rel_error": round(sum(l["k_rel_error"] for l in layers) / len(layers), 4),
        "v_rel_error": round(sum(l["v_rel_error"] for l in layers) / len(layers), 4),
        "perplexity": {k: round(v, 3) for k, v in perplexity.items()},
    }


def markdown(rows: list[dict], source_ppl: dict) -> str:
    slices = list(source_ppl)
    head = "| budget | values/token/layer | rope dim + kv_lora_rank | profile | method | " + " | ".join(
        f"{s} ppl (×source)" for s in slices) + " |"
    lines = [head, "|" + "---|" * (5 + len(slices))]
    lines.append(f"| 100% (source) | {rows[0]['source_values'] if rows else ''} | — | — | source | "
                 + " | ".join(f"{source_ppl[s]:.2f}" for s in slices) + " |")
    for row in rows:
        cells = " | ".join(f"{row['perplexity'][s]:.2f} (×{row['perplexity'][s] / source_ppl[s]:.2f})" for s in slices)
        lines.append(f"| {100 * row['budget']:.2f}% | {row['values_per_token_per_layer']} | {row['rope_dim']} + {row['kv_lora_rank']} | "
                     f"{row['profile']} | {row['method']} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="source model (default: the cached SmolLM2-135M GGUF)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.3125, 0.1875, 0.125])
    parser.add_argument("--methods", nargs="+", default=["weight-svd", "act-pca", "act-attention-seq", "act-attention-refit"],
                        choices=list(METHODS))
    parser.add_argument("--profiles", nargs="+", default=["exact", "portable"], choices=["exact", "portable"])
    parser.add_argument("--rope-dims", type=int, nargs="+", default=None, help="rope/rank splits to sweep (same total)")
    parser.add_argument("--full-rank", action="store_true", help="keep the full latent rank (measures the rope cut alone)")
    parser.add_argument("--norm-calibration", default="auto", choices=["auto", "rms", "mean", "channel", "stabilized"])
    parser.add_argument("--calib", default="default")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seq-len", type=int, default=256)
    parser.add_argument("--slices", nargs="+", default=list(SLICES), choices=list(SLICES))
    parser.add_argument("--windows", type=int, default=32, help="512-token windows per slice (32 = the acceptance slices)")
    parser.add_argument("--work", default=None, help="folder for temporary checkpoints")
    parser.add_argument("--json", default=None, help="also write the summary JSON here")
    args = parser.parse_args(argv)

    from mha2mla.data.assets import default_model_gguf
    from mha2mla.io.source import resolve_source

    source = resolve_source(args.model or default_model_gguf())
    source_ppl = {k: round(v, 3) for k, v in evaluate(source, args.slices, args.windows * 512).items()}
    source_values = json.loads((source / "config.json").read_text())
    source_values = 2 * source_values.get("num_key_value_heads", source_values["num_attention_heads"]) * (
        source_values.get("head_dim") or source_values["hidden_size"] // source_values["num_attention_heads"])
    print(json.dumps({"source": str(source), "perplexity": source_ppl}), flush=True)
    rows = []
    for budget in args.budgets:
        for rope_dim in args.rope_dims or [None]:
            for method in args.methods:
                for profile in args.profiles:
                    row = run_one(source, budget, rope_dim, method, profile, args)
                    row["source_values"] = source_values
                    row["ratio"] = {k: round(row["perplexity"][k] / source_ppl[k], 3) for k in args.slices}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = {"source_perplexity": source_ppl, "windows": args.windows, "calib": args.calib,
               "calib_samples": args.calib_samples, "calib_seq_len": args.calib_seq_len, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(markdown(rows, source_ppl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
