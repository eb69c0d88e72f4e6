"""Training-free conversion quality: held-out perplexity of converted models, per KV budget and method.

    OMP_NUM_THREADS=1 python benchmarks/quality.py --budgets 0.3125 0.1875 0.125 --profiles exact portable
    OMP_NUM_THREADS=1 python benchmarks/quality.py --budgets 0.3125 --methods default no-reconstruct weight-only

The methods are the product's conversions, named by the `mha2mla convert` options that select them (METHODS
below): ``default`` (calibrated, refit, layer-wise reconstruction), ``no-reconstruct`` (``--no-reconstruct``) and
``weight-only`` (``--calib none``). The ablations of the steps before them are settled; their figures are in
docs/benchmarks.md.

For each budget, method and profile it converts the model (default: SmolLM2-135M-Instruct from the
cached GGUF), loads the result with transformers and scores the held-out KJV and Python-docs slices
(``mha2mla.evaluation.perplexity``: 16,384 tokens from a third of the way in, 32 × 512 windows; never
used for calibration — calibration reads the bundled sample). It prints one JSON object per
conversion, then the JSON record (benchmarks/harness.py) and a Markdown table with the ratio to the source model.
``--rope-dims`` sweeps the rope/rank split at each budget (default: the plan's split). ``--compute-dtypes float32
bfloat16`` converts each setting once per compute dtype, side by side in one run (mha2mla/compute.py), and adds
the wall time and the per-phase seconds summed over the layers (reconstruction; the rest of each layer) to each row:

    OMP_NUM_THREADS=2 python benchmarks/quality.py --budgets 0.3125 0.125 \
        --profiles portable --compute-dtypes float32 bfloat16

``--family-smoke`` converts a tiny random source of every family (the tests' builder, tests/common.py) instead and
prints the logit errors against the source.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import harness

# name -> the `mha2mla convert` options (ConvertConfig fields) that select the product's conversion method
METHODS: dict[str, dict] = {
    "default": {},  # calibrated: attention-aware latent, refit, layer-wise reconstruction
    "no-reconstruct": {"reconstruct": False},  # `--no-reconstruct`
    "weight-only": {"calib": "none"},  # `--calib none`: SVD of the K/V weights, nothing calibrated
}
DEFAULT_METHOD = "default"


SLICES = harness.HELD_OUT_SLICES


def run_one(source: Path, budget: float, rope_dim: int | None, method: str, profile: str, args,
            compute_dtype: str = "auto") -> dict:
    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    options = dict(profile=profile, kv_budget=budget, rope_stride=args.rope_stride, **METHODS[method])
    if method != "weight-only":  # the weight-only path calibrates nothing and computes nothing to give a dtype to
        options.update(calib=args.calib, calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                       compute_dtype=compute_dtype)
    if rope_dim is not None or args.full_rank:  # the same total cache as the budget, another rope/rank split
        plan = convert(source, None, ConvertConfig(**options), dry_run=True, progress=False).plan
        options.update(kv_budget=None, rope_dim=rope_dim or plan.rope_dim)
        full = 2 * plan.shape.num_kv_heads * plan.shape.head_dim + plan.extra_channels
        options["kv_lora_rank"] = full if args.full_rank else plan.kv_lora_rank + plan.rope_dim - options["rope_dim"]
    options = ConvertConfig(**options)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        started = time.time()
        result = convert(source, Path(tmp) / "out", options, progress=False, command="benchmarks/quality.py")
        seconds = time.time() - started
        perplexity = harness.perplexities(Path(tmp) / "out", args.slices, args.windows * 512)
    layers = result.report.layers
    return {
        "budget": budget, "method": method, "profile": profile,
        "rope_dim": result.plan.rope_dim, "kv_lora_rank": result.plan.kv_lora_rank, "rope_pairs": list(result.plan.rope_pairs),
        "calib_samples": None if result.plan.calibration is None else result.plan.calibration.samples,
        "values_per_token_per_layer": result.plan.rope_dim + result.plan.kv_lora_rank,
        "methods": result.report.methods, "convert_seconds": round(seconds, 1),
        "compute_dtype": result.plan.compute_dtype,
        "layer_seconds": round(sum(l["seconds"] for l in layers), 1),
        "reconstruction_seconds": round(sum(l.get("reconstruction_seconds", 0.0) for l in layers), 1),
        "k_rel_error": round(sum(l["k_rel_error"] for l in layers) / len(layers), 4),
        "v_rel_error": round(sum(l["v_rel_error"] for l in layers) / len(layers), 4),
        "perplexity": {k: round(v, 3) for k, v in perplexity.items()},
    }


def markdown(rows: list[dict], source_ppl: dict) -> str:
    slices = list(source_ppl)
    head = "| budget | values/token/layer | rope dim + kv_lora_rank | profile | method | compute | convert s | " + " | ".join(
        f"{s} ppl (×source)" for s in slices) + " |"
    lines = [head, "|" + "---|" * (7 + len(slices))]
    lines.append(f"| 100% (source) | {rows[0]['source_values'] if rows else ''} | — | — | source | — | — | "
                 + " | ".join(f"{source_ppl[s]:.2f}" for s in slices) + " |")
    for row in rows:
        cells = " | ".join(f"{row['perplexity'][s]:.2f} (×{row['perplexity'][s] / source_ppl[s]:.2f})" for s in slices)
        lines.append(f"| {100 * row['budget']:.2f}% | {row['values_per_token_per_layer']} | {row['rope_dim']} + {row['kv_lora_rank']} | "
                     f"{row['profile']} | {row['method']} | {row['compute_dtype']} | {row['convert_seconds']} | {cells} |")
    return "\n".join(lines)


# tiny random sources per family (tests/common.py builds them): model type, config extras, dims of a head that rotate
SMOKE_FAMILIES = {
    "llama": ("llama", {}, 16),
    "mistral": ("mistral", {}, 16),
    "qwen2": ("qwen2", {}, 16),
    "phi3": ("phi3", {"partial_rotary_factor": 0.75,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}}, 12),
    "granite": ("granite", {"embedding_multiplier": 6.0, "attention_multiplier": 0.2, "residual_multiplier": 0.4,
                            "logits_scaling": 3.0}, 16),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0]}, 16),
    "qwen3": ("qwen3", {}, 16),
}


def _tests_common():
    """The tests' tiny-model builders (tests/common.py), loaded from their file."""
    spec = importlib.util.spec_from_file_location("tests_common", harness.REPO / "tests" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def family_smoke(work: str | None) -> list[dict]:
    """Each family's tiny random source (4 query heads of 16 dims, hidden 64) converted at full capacity (exact
    profile, float32 compute, an MQA source: exact up to float32 except where the format approximates — Qwen3's q/k
    norm) and at 31.25% (the default options, a GQA source with 2 KV heads, calibrated on 16 × 64 tokens): logit errors
    against the source."""
    import torch

    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    common = _tests_common()
    build_source, logits = common.build_source, common.logits
    tokens = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(0))
    one_position = torch.arange(0, 384, 12).view(-1, 1)
    rows = []
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for name, (model_type, extra, rotating) in SMOKE_FAMILIES.items():
            settings = {
                # float32 compute: the exact setting (auto computes in bf16 where the CPU has it)
                "MQA, full capacity (exact)": (1, ConvertConfig(profile="exact", kv_lora_rank=33, rope_dim=rotating,
                                                                 calib_samples=16, calib_seq_len=64, compute_dtype="float32")),
                "GQA, 31.25% (default)": (2, ConvertConfig(kv_budget=0.3125, calib_samples=16, calib_seq_len=64)),
            }
            for label, (kv_heads, options) in settings.items():
                source = build_source(Path(tmp) / f"{name}-{kv_heads}", model_type, num_kv_heads=kv_heads, pad_token_id=0, **extra)
                out = Path(tmp) / f"{name}-out"
                convert(source, out, options, progress=False, force=True, command="benchmarks/quality.py --family-smoke")
                row = {"family": name, "setting": label}
                for inputs, key in ((tokens, "sequence"), (one_position, "one position")):
                    reference, converted = logits(source, inputs), logits(out, inputs)
                    row[f"{key} max abs"] = round((converted - reference).abs().max().item(), 5)
                row["top-1 agreement"] = round((logits(out, tokens).argmax(-1) == logits(source, tokens).argmax(-1)).float().mean().item(), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def smoke_markdown(rows: list[dict]) -> str:
    lines = ["| family | setting | max abs logit error (64-token sequences) | at one position | top-1 agreement |", "|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['setting']} | {r['sequence max abs']} | {r['one position max abs']} | {r['top-1 agreement']} |"
              for r in rows]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="source model (default: the cached SmolLM2-135M GGUF)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.3125, 0.1875, 0.125])
    parser.add_argument("--methods", nargs="+", default=[DEFAULT_METHOD],
                        choices=list(METHODS))
    parser.add_argument("--profiles", nargs="+", default=["portable"], choices=["exact", "portable"])
    parser.add_argument("--rope-dims", type=int, nargs="+", default=None, help="rope/rank splits to sweep (same total)")
    parser.add_argument("--full-rank", action="store_true", help="keep the full latent rank (measures the rope cut alone)")
    parser.add_argument("--rope-stride", type=int, default=None, help="keep every s-th rope pair (default: the plan's choice)")
    parser.add_argument("--compute-dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                        help="convert each setting once per compute dtype (side by side in one run)")
    parser.add_argument("--calib", default="default")
    parser.add_argument("--calib-samples", type=int, default=None, help="calibration windows (default: the product's)")
    parser.add_argument("--calib-seq-len", type=int, default=256)
    parser.add_argument("--slices", nargs="+", default=list(SLICES), choices=list(SLICES))
    parser.add_argument("--windows", type=int, default=32, help="512-token windows per slice (32 = the acceptance slices)")
    parser.add_argument("--work", default=None, help="folder for temporary checkpoints")
    parser.add_argument("--family-smoke", action="store_true",
                        help="convert a tiny random source of every family and print the logit errors (no real model)")
    harness.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.family_smoke:
        rows = family_smoke(args.work)
        harness.report("family-smoke", {}, rows, args.json_out, table=smoke_markdown(rows))
        return 0
    source = harness.source_model(args.model)
    source_ppl = {k: round(v, 3) for k, v in harness.perplexities(source, args.slices, args.windows * 512).items()}
    config = json.loads((source / "config.json").read_text())
    source_values = 2 * config.get("num_key_value_heads", config["num_attention_heads"]) * (
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    print(json.dumps({"source": str(source), "perplexity": source_ppl}), flush=True)
    rows = []
    for budget in args.budgets:
        for rope_dim in args.rope_dims or [None]:
            for method in args.methods:
                for profile in args.profiles:
                    for compute_dtype in args.compute_dtypes if method != "weight-only" else ["auto"]:
                        row = run_one(source, budget, rope_dim, method, profile, args, compute_dtype)
                        row["source_values"] = source_values
                        row["ratio"] = {k: round(row["perplexity"][k] / source_ppl[k], 3) for k in args.slices}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    settings = {"source": str(source), "windows": args.windows, "calib": args.calib, "calib_samples": args.calib_samples,
                "calib_seq_len": args.calib_seq_len}
    harness.report("quality", settings, rows, args.json_out, table=markdown(rows, source_ppl), source_perplexity=source_ppl)
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
