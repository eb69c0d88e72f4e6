"""Where a calibrated conversion's time goes, per phase, with the compute dtype float32 and bfloat16 side by side.

    OMP_NUM_THREADS=2 MHA2MLA_CACHE=.cache python benchmarks/convert_phases.py --layers 3 --kv-budget 0.3125

Converts the first ``--layers`` layers of the source (default: the cached SmolLM2-135M GGUF) with the product's
default methods, once per compute dtype (``--compute-dtypes``, default float32 then bfloat16; each on a fresh
calibration stream of the default 256 × 256 tokens), through the pipeline's own per-layer function, and times each
phase: ``measure`` (the statistics), each step kind of the plan (convert/steps/registry.py), ``advance`` (the
stream pushed through the layer) and, inside the fit steps, the source heads' outputs computed once per layer.
Prints one JSON object per compute dtype (seconds per layer and phase) and a Markdown table with the
float32/bf16 ratio per phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict


def timed(totals: dict, name: str, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started
    return wrapper


def run(source: str, compute_dtype: str, args) -> dict:
    from mha2mla.convert import pipeline
    from mha2mla.convert.calibration import stream as stream_module
    from mha2mla.convert.options import ConvertOptions
    from mha2mla.convert.plan.resolve import make_plan
    from mha2mla.convert.source_reader import SourceReader
    from mha2mla.convert.steps import attention, registry
    from mha2mla.families import family_for_config
    from mha2mla.io.source import open_source

    totals: dict[str, float] = defaultdict(float)
    ckpt = open_source(source)
    family = family_for_config(ckpt.config)
    options = ConvertOptions(kv_budget=args.kv_budget, calib_device="cpu", compute_dtype=compute_dtype)
    plan = make_plan(ckpt.config, family, options, source_format="gguf" if source.endswith(".gguf") else "safetensors")
    reader = SourceReader(ckpt, family, plan)
    stream = stream_module.calibration_stream(reader)
    saved = (pipeline.measure, attention.step, stream_module.CalibrationStream.advance,
             stream_module.LayerActivations.source_heads)
    pipeline.measure = timed(totals, "measure", pipeline.measure)
    attention.step = lambda kind, name: dataclasses.replace(registry.step(kind, name),
                                                            function=timed(totals, kind, registry.step(kind, name).function))
    stream_module.CalibrationStream.advance = timed(totals, "advance", saved[2])
    stream_module.LayerActivations.source_heads = timed(totals, "source heads (inside the fit steps)", saved[3])
    try:
        started = time.perf_counter()
        for layer in range(args.layers):
            pipeline._convert_layer(reader, layer, stream, None)
        wall = time.perf_counter() - started
    finally:
        (pipeline.measure, attention.step, stream_module.CalibrationStream.advance,
         stream_module.LayerActivations.source_heads) = saved
    per_layer = {name: round(seconds / args.layers, 2) for name, seconds in totals.items()}
    return {"compute_dtype": plan.compute_dtype, "layers": args.layers, "seconds_per_layer": round(wall / args.layers, 2),
            "phases_per_layer": per_layer}


def markdown(rows: list[dict]) -> str:
    names = list(dict.fromkeys(name for row in rows for name in row["phases_per_layer"]))
    lines = ["| phase (s per layer) | " + " | ".join(row["compute_dtype"] for row in rows) + " | ratio |",
             "|---|" + "---|" * (len(rows) + 1)]
    for name in names + ["whole layer"]:
        values = [row["seconds_per_layer"] if name == "whole layer" else row["phases_per_layer"].get(name, 0.0)
                  for row in rows]
        ratio = f"×{values[0] / values[-1]:.2f}" if len(values) > 1 and values[-1] > 0 else "—"
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="source model (default: the cached SmolLM2-135M GGUF)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--kv-budget", type=float, default=0.3125)
    parser.add_argument("--compute-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    from mha2mla.io.cache import cached_default_model

    source = str(args.model or cached_default_model())
    rows = []
    for compute_dtype in args.compute_dtypes:
        rows.append(run(source, compute_dtype, args))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
