"""Recovery, the curve and the score: healing SmolLM2-135M's small-budget conversions with `mha2mla recover`. Each run is the CLI itself
(timed wall clock, its own curve on a small held-out slice), then every output is scored on the acceptance slices
(16,384 tokens of the KJV and of the Python docs, 512-token windows, as benchmarks/quality.py) next to the source.

    python benchmarks/heal.py prepare                                   # training text + curve slices, once
    OMP_NUM_THREADS=1 python benchmarks/heal.py run NAME --converted PATH [--no-data] -- \
        --full-layers --lr 3e-4 ...
    python benchmarks/heal.py score NAME [NAME ...] [--converted PATH ...]   # JSON + Markdown table
    python benchmarks/heal.py regions NAME [NAME ...] [--converted PATH ...] # × source along each text

``run`` passes everything after ``--`` to `mha2mla recover` (data, held-out curve slice, seq len 512 and the
output folder WORK/NAME are set here unless given; ``--no-data`` drops the training text, for teacher-generated
text). Training text: ``mha2mla.io.assets.healing_text_path()`` (the first 30% of the KJV and of the Python docs,
every ~4000-character document of those parts, interleaved by position; ``--data`` after ``--`` for another, e.g.
the balanced one of the 12.5% recipe), far from the held-out slices, which start a third into each file. The curve slice is the first 2,048 tokens of each acceptance slice (8 rows of 512).
WORK is --work (default ``$MHA2MLA_CACHE/heal``). Training speed side by side: benchmarks/recover_speed.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import HELD_OUT_SLICES as SLICES
from harness import SLICE_TOKENS

CURVE_TOKENS = 2048


def prepare(work: Path) -> None:
    """The healing text (mha2mla.io.assets) and WORK/curve_<slice>.txt (the first CURVE_TOKENS tokens of each
    acceptance slice)."""
    from transformers import AutoTokenizer

    from mha2mla.io.assets import healing_text_path

    work.mkdir(parents=True, exist_ok=True)
    healing_text_path()
    tokenizer = AutoTokenizer.from_pretrained(str(harness.source_model()))
    for name in SLICES:
        ids = harness.held_out_ids(tokenizer, name, CURVE_TOKENS)
        (work / f"curve_{name}.txt").write_text(tokenizer.decode(ids), encoding="utf-8")
    print(f"training text and curve slices in {work}")


def run(work: Path, name: str, converted: str, extra: list[str], no_data: bool) -> None:
    """`mha2mla recover` as a user runs it (resumed if interrupted); wall time appended to WORK/NAME.wall.json."""
    from mha2mla.io.assets import healing_text_path

    out = work / name
    given = set(extra)
    argv = [sys.executable, "-m", "mha2mla.cli.main", "recover", converted, "--out", str(out), "--no-progress"]
    if not no_data and "--data" not in given:
        argv += ["--data", str(healing_text_path())]
    if "--eval-data" not in given:
        argv += [arg for name_ in SLICES for arg in ("--eval-data", str(work / f"curve_{name_}.txt"))]
        argv += ["--eval-sequences", str(2 * CURVE_TOKENS // 512)]
    if "--seq-len" not in given:
        argv += ["--seq-len", "512"]
    if out.exists() and not (out / "recovery_report.json").is_file():
        argv += ["--resume", "auto"]
    started = time.perf_counter()
    subprocess.run(argv + extra, check=True, cwd=harness.REPO)
    wall = time.perf_counter() - started
    record = {"name": name, "command": " ".join(["mha2mla", *argv[3:], *extra]), "wall_seconds": round(wall, 1),
              "threads": os.environ.get("OMP_NUM_THREADS")}
    with open(work / f"{name}.wall.json", "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record))


def score(work: Path, names: list[str], converted: list[str], json_out: str | None = None) -> None:
    """Acceptance-slice perplexity of the source, of each converted starting point and of each run's output."""
    source_file = work / "source_perplexity.json"
    if not source_file.is_file():  # the dequantized GGUF, scored as benchmarks/quality.py scores it
        source_file.write_text(json.dumps(harness.perplexities(harness.source_model(), SLICES, SLICE_TOKENS)))
    source = json.loads(source_file.read_text())
    rows = []
    for label, folder in [*((Path(c).name, Path(c)) for c in converted), *((n, work / n) for n in names)]:
        row = {"model": label, "perplexity": harness.perplexities(folder, SLICES, SLICE_TOKENS)}
        row["x_source"] = {k: round(v / source[k], 3) for k, v in row["perplexity"].items()}
        report = folder / "recovery_report.json"
        if report.is_file():
            data = json.loads(report.read_text())
            row.update(tokens=data["tokens_trained"], tokens_per_second=round(data["tokens_per_second"], 1),
                       curve=[(e["tokens"], round(e["perplexity"], 2)) for e in data["evaluations"]])
            walls = (work / f"{label}.wall.json")
            if walls.is_file():
                row["wall_seconds"] = sum(json.loads(line)["wall_seconds"] for line in walls.read_text().splitlines())
        rows.append(row)
    lines = [f"source: KJV {source['kjv']:.2f}, Python docs {source['python_docs']:.2f}", "",
             "| model | tokens | wall s | KJV ppl (× source) | Python docs ppl (× source) |", "|---|---:|---:|---|---|"]
    for row in rows:
        cells = " | ".join(f"{row['perplexity'][s]:.2f} (×{row['x_source'][s]:.3f})" for s in SLICES)
        lines.append(f"| {row['model']} | {row.get('tokens', 0):,} | {row.get('wall_seconds', '')} | {cells} |")
    harness.report("recovery", {"work": str(work), "slice_tokens": SLICE_TOKENS}, rows, json_out, table="\n".join(lines),
                   source_perplexity=source)


REGIONS = {"kjv": (0.1, 0.333, 0.6), "python_docs": (0.02, 0.08, 0.13, 0.2, 0.25, 0.333, 0.5, 0.75)}
REGION_TOKENS = 4096


def regions(work: Path, names: list[str], converted: list[str], json_out: str | None = None) -> None:
    """Perplexity on REGION_TOKENS tokens starting at several fractions of each text, for the source and each model
    and its ratio to the source: how a healed model fares on its training text (the first 30%), on the held-out
    slice (a third in) and beyond it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.evaluation.perplexity import window_perplexity

    models = [("source", harness.source_model()), *((Path(c).name, Path(c)) for c in converted),
              *((n, work / n) for n in names)]
    table: dict[str, dict[str, float]] = {}
    for label, folder in models:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        for text, fractions in REGIONS.items():
            for fraction in fractions:
                ids = harness.held_out_ids(tokenizer, text, REGION_TOKENS, fraction)
                table.setdefault(f"{text} at {fraction}", {})[label] = window_perplexity(model, ids, 512)
    labels = [label for label, _ in models]
    lines = ["| region | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for region, row in table.items():
        cells = [f"{row['source']:.2f}"] + [f"{row[x]:.2f} (×{row[x] / row['source']:.3f})" for x in labels[1:]]
        lines.append(f"| {region} | " + " | ".join(cells) + " |")
    rows = [{"region": region, **row} for region, row in table.items()]
    harness.report("recovery-regions", {"region_tokens": REGION_TOKENS}, rows, json_out, table="\n".join(lines))


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["prepare", "run", "score", "regions"])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--converted", action="append", default=[])
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: $MHA2MLA_CACHE/heal)")
    parser.add_argument("--no-data", action="store_true", help="no --data: the teacher generates the training text")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.work = args.work or harness.cache_path("heal")
    if args.step == "prepare":
        prepare(args.work)
    elif args.step == "run":
        if len(args.names) != 1 or len(args.converted) != 1:
            parser.error("run takes one NAME and one --converted")
        run(args.work, args.names[0], args.converted[0], extra, args.no_data)
    elif args.step == "regions":
        regions(args.work, args.names, args.converted, args.json_out)
    else:
        score(args.work, args.names, args.converted, args.json_out)


if __name__ == "__main__":
    sys.exit(harness.run(main))
