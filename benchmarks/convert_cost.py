"""Conversion cost: the default conversion against its floor, phase by phase, in one process.

    OMP_NUM_THREADS=2 python benchmarks/convert_cost.py --kv-budget 0.3125 --quality     # whole SmolLM2-135M
    OMP_NUM_THREADS=1 python benchmarks/convert_cost.py --shape llama3-8b --layers 1      # one layer, Llama-3-8B widths
    OMP_NUM_THREADS=1 python benchmarks/convert_cost.py --first-layers 4 --quality --windows 8   # a cut SmolLM2

The source is the cached SmolLM2-135M-Instruct (``make assets``; ``--model`` for another) or, with ``--shape``, a
random-weight source with the real layer widths built by benchmarks/scale.py (its vocabulary of ``--vocab`` tokens);
``--first-layers N`` cuts the source after its first N decoder layers (embedding, final norm and LM head kept).

The **floor** is one forward of the whole source (embedding, every decoder layer, final norm, LM head) over the
very calibration tokens the conversion reads, in the conversion's compute dtype, threads and batch size (logits
made and dropped batch by batch). Then the **default conversion** (``mha2mla.convert.pipeline.convert`` with the
product's options; ``--kv-budget``, ``--compute-dtype``, ``--calib-samples`` as convert's) runs in the same process,
its phases read from the conversion report (``phase_seconds``, ``phase_cpu_seconds``: exclusive wall and CPU
seconds per phase, listed in mha2mla/convert/phases.py); "other" here also holds the source's opening and planning.

With ``--calib-device cuda`` the floor runs on the GPU too, and the conversion's clock waits for the GPU at every phase
boundary (so each phase is charged with its own kernels). Wall and CPU seconds (the process's, every thread's): on a machine other jobs share, the CPU ratio moves far less with
their load. Peak memory of the conversion alone: VmHWM, reset after the floor (``/proc/self/clear_refs``).
``--quality`` adds the held-out perplexity of the converted model (mha2mla.evaluation.perplexity; for a
``--first-layers`` cut no quality figure, only a check that two runs agree). Prints the floor as a JSON line as soon
as it is measured, then the JSON record and a Markdown table (benchmarks/harness.py: the measurement is appended to
benchmarks/records/convert_cost.jsonl, or ``--records PATH``); the figure is conversion / floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import harness

GIB = 1024**3


def clocks() -> tuple[float, float]:
    """(wall, CPU) seconds now: the process's CPU time, every thread's, moves far less than wall time with other jobs' load."""
    return time.perf_counter(), time.process_time()


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def floor_seconds(source: Path, options) -> tuple[float, dict]:
    """One forward of the whole source over the conversion's calibration tokens, as the conversion would run it."""
    import torch
    from transformers import AutoModelForCausalLM

    from mha2mla.compute import torch_dtype
    from mha2mla.convert.calibration.memory import calibration_batch
    from mha2mla.convert.plan.resolve import make_plan
    from mha2mla.families import family_for_config
    from mha2mla.io.source import open_source

    ckpt = open_source(source)
    plan = make_plan(ckpt.config, family_for_config(ckpt.config), options)
    tokens = _calibration_tokens(plan, ckpt.folder)
    dtype = torch_dtype(plan.compute_dtype)
    device = torch.device(options.calib_device)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt.folder), dtype=dtype, attn_implementation="sdpa").eval()
    model, tokens, batch = model.to(device), tokens.to(device), calibration_batch(plan)
    sync = device_sync(device)
    sync()
    started = clocks()
    with torch.no_grad():
        for start in range(0, tokens.shape[0], batch):
            model(input_ids=tokens[start : start + batch]).logits.float().sum()  # (b, L, vocab), dropped
    sync()
    done = clocks()
    del model
    return done[0] - started[0], {"compute_dtype": plan.compute_dtype, "tokens": list(tokens.shape), "batch": batch,
                                  "device": str(device), "cpu_seconds": round(done[1] - started[1], 2)}


def device_sync(device):
    """What waits for ``device``'s queued work: a CUDA synchronize, nothing on the CPU."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _calibration_tokens(plan, folder: Path):
    """The (N, L) token ids the conversion's calibration stream reads (calibration/stream.py: text, tokenizer, windows)."""
    from transformers import AutoTokenizer

    from mha2mla.convert.calibration.data import calibration_documents, calibration_token_ids

    settings = plan.calibration
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return calibration_token_ids(calibration_documents(settings.text), tokenizer, settings.samples, settings.seq_len)


def conversion(source: Path, options, work: str | None, quality: bool, windows: int) -> dict:
    """The default conversion, its phases as its report gives them (convert/phases.py); its held-out perplexity
    when ``quality``."""
    from mha2mla.convert.pipeline import convert

    reset_peak_rss()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        started = clocks()
        result = convert(source, Path(tmp) / "out", options, progress=True, command="benchmarks/convert_cost.py")
        wall, cpu = (end - start for end, start in zip(clocks(), started))
        peak = peak_rss()
        perplexity = _perplexity(Path(tmp) / "out", windows) if quality else None
    report = result.report
    # the report's "other" starts when the pipeline opens its clock; the source's opening and planning before it
    phases, cpu_phases = dict(report.phase_seconds), dict(report.phase_cpu_seconds)
    phases["other"] = round(wall - sum(v for k, v in phases.items() if k != "other"), 2)
    cpu_phases["other"] = round(cpu - sum(v for k, v in cpu_phases.items() if k != "other"), 2)
    layers = report.layers
    return {"seconds": round(wall, 2), "phases": phases, "cpu_seconds": round(cpu, 2), "cpu_phases": cpu_phases,
            "peak_rss_gib": round(peak / GIB, 3), "peak_gpu_gib": report.peak_gpu_gib,
            "reconstruction_steps": sum(layer.get("reconstruction_steps", 0) for layer in layers),
            # per layer: the held-out error at each of the reconstruction's measurements (every EVAL_EVERY steps)
            "reconstruction_curves": [layer["reconstruction_curve"] for layer in layers if "reconstruction_curve" in layer],
            "layers": len(layers), "plan": {"kv_lora_rank": result.plan.kv_lora_rank, "rope_dim": result.plan.rope_dim,
                                            "compute_dtype": result.plan.compute_dtype},
            "perplexity": perplexity}


def _perplexity(folder: Path, windows: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.evaluation.perplexity import held_out_perplexity
    from mha2mla.io.cache import HELD_OUT_TEXTS, held_out_text_path
    from mha2mla.kernels.sdpa import mla_attention_for

    config = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 attn_implementation=mla_attention_for(config, "sdpa")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return {name: round(held_out_perplexity(model, tokenizer, held_out_text_path(name), num_tokens=windows * 512), 3)
            for name in HELD_OUT_TEXTS}


def first_layers(source: Path, layers: int, folder: Path) -> Path:
    """A source made of ``source``'s first ``layers`` decoder layers (its own embedding, final norm, LM head and
    tokenizer): the same per-layer work at a fraction of the time (reused when already built)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").is_file() and json.loads((folder / "config.json").read_text())["num_hidden_layers"] == layers:
        return folder
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    if layers > len(model.model.layers):
        raise SystemExit(f"--first-layers {layers}: the source has {len(model.model.layers)} layers")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
    return folder


def markdown(row: dict) -> str:
    floor, floor_cpu, convert = row["floor_seconds"], row["floor"]["cpu_seconds"], row["conversion"]
    cut = f", first {row['first_layers']} layers" if row.get("first_layers") else ""
    lines = [f"{row['shape']}{cut}, KV budget {row['kv_budget']}, {convert['plan']['compute_dtype']}, "
             f"{row['threads']} thread(s), load average {row['load_average'][0]:.1f} before\n",
             "| measured | seconds | × floor | CPU seconds | × floor (CPU) |", "|---|---:|---:|---:|---:|",
             f"| floor: one forward of the source over the calibration tokens | {floor:.1f} | 1.00 | "
             f"{floor_cpu:.1f} | 1.00 |"]
    for name, seconds in sorted(convert["phases"].items(), key=lambda item: -item[1]):
        cpu = convert["cpu_phases"].get(name, 0.0)
        lines.append(f"| {name} | {seconds:.1f} | {seconds / floor:.2f} | {cpu:.1f} | {cpu / floor_cpu:.2f} |")
    lines.append(f"| **conversion** | **{convert['seconds']:.1f}** | **{convert['seconds'] / floor:.2f}** | "
                 f"**{convert['cpu_seconds']:.1f}** | **{convert['cpu_seconds'] / floor_cpu:.2f}** |")
    gpu = f", peak GPU memory {convert['peak_gpu_gib']:.2f} GiB" if convert.get("peak_gpu_gib") is not None else ""
    lines.append(f"\npeak RSS of the conversion {convert['peak_rss_gib']:.2f} GiB{gpu}; perplexity {convert['perplexity']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="source model (default: the cached SmolLM2-135M GGUF)")
    parser.add_argument("--shape", default=None, help="a random-weight source of benchmarks/scale.py (llama3-8b, ...)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of a --shape source")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary of a --shape source")
    parser.add_argument("--first-layers", type=int, default=None,
                        help="convert only the source's first N decoder layers (a source cut there; labelled so)")
    parser.add_argument("--kv-budget", type=float, default=None, help="convert's --kv-budget (default: its own)")
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--calib-samples", type=int, default=None, help="convert's --calib-samples (default: its own)")
    parser.add_argument("--calib-device", default="cpu")
    parser.add_argument("--quality", action="store_true", help="score the converted model on the held-out texts")
    parser.add_argument("--windows", type=int, default=32, help="512-token held-out windows per text (--quality)")
    parser.add_argument("--work", default=None, help="folder for the temporary output (made if missing; default: the system's)")
    harness.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import os

    if args.work:  # made before the floor, so a bad path fails in a second, not after it
        Path(args.work).mkdir(parents=True, exist_ok=True)

    import torch

    from mha2mla.convert.config import ConvertConfig
    from mha2mla.io.cache import cache_dir, cached_default_model
    from mha2mla.io.source import resolve_source

    if args.shape:
        from scale import build_source  # benchmarks/scale.py, beside this script

        folder = cache_dir() / "scale" / f"{args.shape}-{args.layers}l-v{args.vocab}"
        source = build_source(args.shape, args.layers, args.vocab, torch.bfloat16, folder)
    else:
        source = resolve_source(args.model or cached_default_model())
    if args.first_layers:
        source = first_layers(source, args.first_layers, cache_dir() / "convert_cost" / f"{source.name}-first-{args.first_layers}")
    options = ConvertConfig(kv_budget=args.kv_budget, compute_dtype=args.compute_dtype,
                             calib_samples=args.calib_samples, calib_device=args.calib_device)
    floor, floor_info = floor_seconds(source, options)
    label = args.shape or (Path(args.model).name if args.model else "SmolLM2-135M")
    row = {"source": str(source), "shape": label, "first_layers": args.first_layers,
           "kv_budget": options.budget, "threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get(
               "OMP_NUM_THREADS"), "load_average": os.getloadavg(), "floor_seconds": round(floor, 2), "floor": floor_info}
    print(json.dumps(row), flush=True)  # the floor first: a conversion stopped later still leaves it
    row["conversion"] = conversion(source, options, args.work, args.quality, args.windows)
    row["conversion_over_floor"] = round(row["conversion"]["seconds"] / floor, 2)
    row["conversion_over_floor_cpu"] = round(row["conversion"]["cpu_seconds"] / floor_info["cpu_seconds"], 2)
    row["load_average_after"] = os.getloadavg()
    settings = {key: getattr(args, key) for key in ("model", "shape", "layers", "vocab", "first_layers", "kv_budget",
                                                    "compute_dtype", "calib_samples", "calib_device", "quality", "windows")}
    print(json.dumps(row), flush=True)  # one line, as gpu_check.sh's summary reads it
    harness.report("convert_cost", settings, [row], args.json_out, table=markdown(row))
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
