"""Conversion time and memory at real 7B-70B layer widths: random-weight sources with only a few layers.

    OMP_NUM_THREADS=2 python benchmarks/scale.py --modes weight-only
    OMP_NUM_THREADS=2 python benchmarks/scale.py --shapes llama2-7b llama3-8b mistral-7b qwen2.5-7b \\
        --modes calibrated --calib-samples 16

No 7B weights can be downloaded here, but their shapes can be built: for each shape (SHAPES below: the layer
widths of Llama-2-7B, Llama-3-8B, Mistral-7B, Qwen2.5-7B and Llama-3-70B) a source with ``--layers`` decoder layers
(default 2) is built with transformers' own config and model classes, its weights drawn at random (the classes'
own initialisation; Qwen2's q/k/v biases drawn too, as they are zero at initialisation) and saved as safetensors in
``--dtype`` (bfloat16, as the published checkpoints are). The vocabulary is a byte-level BPE of ``--vocab`` tokens
(default 4096, trained on the bundled calibration sample) instead of the real 32k-152k: the embedding and LM head are
copied as they are and are not per-layer work.

Each source is converted by ``mha2mla convert`` in a child process (``--calib none`` for weight-only; the bundled
sample with ``--calib-samples`` windows for calibrated), so the peak RSS is the conversion's own: ``os.wait4`` gives
the child's ``ru_maxrss``, the same figure ``/usr/bin/time -v`` prints. While it runs, the child's RssAnon is read
from /proc every 0.1 s and at each ``k/N`` of the conversion's progress bar (stderr); the time per layer is the bar's
own average rate over the layer loop (``s/layer``, measured inside the child, ``TQDM_SMOOTHING=0``). A child over
``--max-rss-gib``, one that leaves the machine less than ``--min-free-gib`` of memory, or one still running after
``--max-minutes`` is killed and recorded as such (with the RSS it had reached), never given a number it did not reach.

``--compute-dtypes float32 bfloat16`` runs each calibrated mode once per compute dtype (convert's
``--compute-dtype``, mha2mla/compute.py), side by side in one run:

    OMP_NUM_THREADS=2 python benchmarks/scale.py --shapes llama3-8b --modes calibrated-no-recon --layers 1 \
        --calib-samples 16 --calib-device cpu --compute-dtypes float32 bfloat16

Per conversion it prints one JSON line and appends it as a record (benchmarks/harness.py: benchmarks/records/scale.jsonl,
or ``--records PATH``); at the end a Markdown table. The full-depth figures (32 / 28 / 80 layers)
are extrapolated, and labelled so: time = startup + depth x mean layer time + finish; peak RSS = measured peak +
(depth - layers built) x the measured growth of anonymous memory per layer (0 when it does not grow).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness
from scale_shapes import SHAPES, build_source
from scale_shapes import build_tokenizer as build_tokenizer  # benchmarks/gpu_check.sh imports it from here

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3

# calibrated: the default (refit + reconstruction); calibrated-no-recon: `--no-reconstruct`
MODES = ("weight-only", "calibrated", "calibrated-no-recon")
PROGRESS = re.compile(r"converting[^|]*\|[^|]*\|\s*(\d+)/(\d+)")
# the bar's own measure of the layer loop so far: "k/N [mm:ss<mm:ss, 2.61s/layer]" (or "1.50layer/s" when faster)
RATE = re.compile(r"(\d+)/\d+ \[[\d:]+<[^,]*,\s*([\d.]+)(s/layer|layer/s)")


# ------------------------------------------------------------------------------------------- one conversion


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of ``pid`` in bytes (empty once it has exited)."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return values


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Watch:
    """What the parent saw of one child: progress events (layers done, seconds, RssAnon), peaks, a kill reason."""

    started: float
    layer_events: list = field(default_factory=list)  # (layers done, seconds since start, RssAnon bytes)
    seconds_per_layer: float | None = None  # the progress bar's own rate over the whole layer loop
    peak_anon: int = 0
    peak_rss: int = 0
    killed: str | None = None
    stderr_tail: str = ""
    seconds: float = 0.0


def _read_progress(stream, pid: int, watch: Watch) -> None:
    """Time each ``k/N`` of the conversion's progress bar as it is printed (tqdm separates updates with \\r)."""
    seen, buffer = set(), ""
    for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):  # whatever has arrived, not a fixed count
        buffer += chunk.decode("utf-8", errors="replace")
        parts = re.split(r"[\r\n]", buffer)
        buffer = parts.pop()
        for part in parts:
            match = PROGRESS.search(part)
            rate = RATE.search(part)
            if rate and int(rate.group(1)) > 0:  # the last one seen covers the whole loop (k = N at the end)
                value = float(rate.group(2))
                watch.seconds_per_layer = value if rate.group(3) == "s/layer" else 1 / value
            if match and int(match.group(1)) not in seen:
                seen.add(int(match.group(1)))
                anon = _proc_status(pid).get("RssAnon", 0)
                watch.layer_events.append((int(match.group(1)), time.perf_counter() - watch.started, anon))
            elif part.strip():
                watch.stderr_tail = (watch.stderr_tail + part + "\n")[-3000:]


def _watch(process: subprocess.Popen, watch: Watch, max_rss: int, min_free: int, max_seconds: float):
    """Poll the child every 0.1 s (its RSS, the machine's free memory, its time) until it exits, killing it past
    the limits.
    Returns ``os.wait4``'s status and rusage: the child's own, reaped here rather than by Popen."""
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            return status, usage
        current = _proc_status(process.pid)
        watch.peak_anon = max(watch.peak_anon, current.get("RssAnon", 0))
        watch.peak_rss = max(watch.peak_rss, current.get("VmRSS", 0))
        reason = None
        if current.get("VmRSS", 0) > max_rss:
            reason = f"killed: RSS passed --max-rss-gib {max_rss / GIB:.1f}"
        elif _available_memory() < min_free:
            reason = f"killed: the machine had less than {min_free / GIB:.1f} GiB free (out of memory)"
        elif time.perf_counter() - watch.started > max_seconds:
            reason = f"killed: still running after --max-minutes {max_seconds / 60:g} (time, not memory)"
        if reason and watch.killed is None:
            watch.killed = f"{reason} at {current.get('VmRSS', 0) / GIB:.2f} GiB RSS"
            process.send_signal(signal.SIGKILL)
        time.sleep(0.1)


def convert_command(source: Path, out: Path, mode: str, args, compute_dtype: str = "auto") -> list[str]:
    command = [sys.executable, "-m", "mha2mla.cli.main", "convert", str(source), str(out), "--progress", "--force"]
    command += ["--kv-budget", str(args.kv_budget)]
    if mode == "weight-only":
        return command + ["--calib", "none"]
    command += ["--calib", "default", "--calib-samples", str(args.calib_samples), "--compute-dtype", compute_dtype]
    command += ["--no-reconstruct"] if mode == "calibrated-no-recon" else []
    return command + (["--calib-device", args.calib_device] if args.calib_device else [])


def run_conversion(command: list[str], args) -> tuple[Watch, int, int]:
    """Run one conversion child: (what was watched, exit status, the child's own ru_maxrss in bytes)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TQDM_MINITERS": "1", "TQDM_SMOOTHING": "0"}  # tqdm's own overrides: every layer shown, the mean rate
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watch = Watch(started=time.perf_counter())
    reader = threading.Thread(target=_read_progress, args=(process.stderr, process.pid, watch), daemon=True)
    reader.start()
    status, usage = _watch(process, watch, int(args.max_rss_gib * GIB), int(args.min_free_gib * GIB), args.max_minutes * 60)
    process.returncode = os.waitstatus_to_exitcode(status)
    watch.seconds = time.perf_counter() - watch.started
    reader.join(timeout=10)
    return watch, process.returncode, usage.ru_maxrss * 1024


def summarise(name: str, mode: str, layers: int, watch: Watch, code: int, max_rss: int) -> dict:
    """One JSON row: measured per-layer figures and the full-depth extrapolation (labelled as such)."""
    depth = SHAPES[name][2]
    row = {"shape": name, "mode": mode, "layers_built": layers, "full_depth": depth, "exit_code": code,
           "wall_seconds": round(watch.seconds, 2), "peak_rss_gib": round(max_rss / GIB, 3),
           "peak_anon_rss_gib": round(watch.peak_anon / GIB, 3)}
    if watch.killed or code != 0:
        row["status"] = watch.killed or f"failed (exit {code}): {watch.stderr_tail.strip().splitlines()[-1:]}"
        row["peak_rss_gib"] = round(max(max_rss, watch.peak_rss) / GIB, 3)
        row["layers_done"] = max((count for count, _, _ in watch.layer_events), default=0)
        if row["layers_done"] and watch.seconds_per_layer is not None:
            row["seconds_per_layer_done"] = round(watch.seconds_per_layer, 2)
        return row
    row["status"] = "ok"
    events = sorted(watch.layer_events)
    done = {count: seconds for count, seconds, _ in events}
    if layers not in done or watch.seconds_per_layer is None:
        row["status"] = "ok (no per-layer timing: progress bar not seen)"
        return row
    # The bar's rate times the layers is the loop; what came before it is startup (loading, calibration text,
    # embeddings), what came after is finishing (config, absorbed weights, report, rename).
    per_layer = watch.seconds_per_layer
    tail = watch.seconds - done[layers]
    head = max(0.0, watch.seconds - tail - layers * per_layer)
    anon = {count: value for count, _, value in events}
    growth = max(0.0, (anon[layers] - anon[1]) / (layers - 1)) if layers > 1 and 1 in anon else 0.0
    row.update(
        seconds_per_layer=round(per_layer, 2), startup_seconds=round(head, 2), finish_seconds=round(tail, 2),
        anon_growth_per_layer_gib=round(growth / GIB, 4),
        extrapolated_full_depth_seconds=round(head + depth * per_layer + tail, 1),
        extrapolated_full_depth_peak_rss_gib=round((max_rss + (depth - layers) * growth) / GIB, 2),
    )
    return row


# ------------------------------------------------------------------------------------------- report


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | mode | per layer (s, measured) | peak RSS (GiB, measured) | startup + finish (s) | full depth | "
        "time at full depth (extrapolated) | peak RSS at full depth (extrapolated) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        prefix = f"| {row['shape']} | {row['mode']}{'' if row.get('compute_dtype') is None else ', ' + row['compute_dtype']} |"
        if "seconds_per_layer" not in row:
            lines.append(f"{prefix} {row['status']} | {row['peak_rss_gib']:.2f} | — | {row['full_depth']} | — | — |")
            continue
        lines.append(
            f"{prefix} {row['seconds_per_layer']:.1f} | {row['peak_rss_gib']:.2f} | "
            f"{row['startup_seconds']:.0f} + {row['finish_seconds']:.0f} | {row['full_depth']} | "
            f"{row['extrapolated_full_depth_seconds'] / 60:.1f} min | {row['extrapolated_full_depth_peak_rss_gib']:.2f} GiB |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["weight-only"], choices=MODES)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers built per source (default 2)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary of the random sources (default 4096)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-budget", type=float, default=0.25, help="convert's --kv-budget (default 0.25, its own)")
    parser.add_argument("--calib-samples", type=int, default=16, help="calibrated mode's --calib-samples (convert: 128)")
    parser.add_argument("--calib-device", default=None, help="calibrated mode's --calib-device (default: convert's)")
    parser.add_argument("--max-rss-gib", type=float, default=24.0, help="kill a conversion whose RSS passes this")
    parser.add_argument("--min-free-gib", type=float, default=1.0, help="kill a conversion that leaves less free memory")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="kill a conversion still running after this")
    parser.add_argument("--work", default=str(REPO / ".cache" / "scale"), help="sources (kept) and outputs (removed)")
    parser.add_argument("--compute-dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                        help="calibrated modes: convert once per compute dtype (convert's --compute-dtype)")
    harness.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import shutil

    import torch

    from mha2mla.io.model_folder import read_conversion_report

    work = Path(args.work)
    env = harness.environment()
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    rows = []
    for name in args.shapes:
        source = build_source(name, args.layers, args.vocab, getattr(torch, args.dtype), work / f"{name}-{args.layers}l")
        runs = [(mode, dtype) for mode in args.modes for dtype in (args.compute_dtypes if mode != "weight-only" else [None])]
        for mode, compute_dtype in runs:
            out = work / f"{name}-{args.layers}l-{mode}-out"
            watch, code, max_rss = run_conversion(convert_command(source, out, mode, args, compute_dtype or "auto"), args)
            report = read_conversion_report(out)  # None when the conversion did not finish
            for leftover in [out, *work.glob(f".{out.name}*")]:  # the output, or what a killed run staged
                shutil.rmtree(leftover, ignore_errors=True)
            row = summarise(name, mode, args.layers, watch, code, max_rss)
            row.update(vocab=args.vocab, dtype=args.dtype, kv_budget=args.kv_budget, threads=threads, compute_dtype=compute_dtype,
                       calib_samples=args.calib_samples if mode != "weight-only" else None)
            if report is not None:  # the conversion's own figures: seconds per layer, GPU peak when calibrated on one
                row["report_layer_seconds"] = [layer.get("seconds") for layer in report.layers]
                if report.peak_gpu_gib is not None:
                    row["peak_gpu_gib"] = report.peak_gpu_gib
            rows.append(row)
            print(json.dumps(row), flush=True)
            harness.record("scale", {"shape": name, "mode": mode, "layers": args.layers, "vocab": args.vocab,
                                     "kv_budget": args.kv_budget, "compute_dtype": compute_dtype}, row, env)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
