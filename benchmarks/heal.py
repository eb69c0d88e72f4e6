"""Recovery, the curve and the score: healing SmolLM2-135M's small-budget conversions with `mha2mla recover`. Each run is
the CLI itself (timed wall clock, its own curve on a small held-out slice), then every output is scored next to the
source on the in-domain slices (16,384 tokens of the KJV and of the Python docs, whose first 30% the in-domain
healing text reads) and the unseen ones (the same of the fortunes and of the Debian Policy Manual, which no healing
text reads), 512-token windows as benchmarks/quality.py, and on the unseen continuation tasks fortunes_mc and
debian_policy_mc (their items, scored as lm-eval scores them).

    python benchmarks/heal.py prepare                                   # training text + curve slices, once
    OMP_NUM_THREADS=1 python benchmarks/heal.py run NAME --converted PATH [--no-data] -- \
        --full-layers --lr 3e-4 ...
    python benchmarks/heal.py score NAME [NAME ...] [--converted PATH ...] [--items N]   # JSON + Markdown table
    python benchmarks/heal.py curve NAME --converted PATH | mix --generated FOLDER  # along a run's checkpoints | mix
    python benchmarks/heal.py regions NAME [NAME ...] [--converted PATH ...] # × source along each text
    python benchmarks/heal.py step --converted PATH [--lr 2.5e-4]     # one AdamW-sized step per kind of weight

``run`` passes everything after ``--`` to `mha2mla recover` (data, held-out curve slice, seq len 512 and the
output folder WORK/NAME are set here unless given; ``--no-data`` drops the training text: the run's default healing
text). Training text: ``mha2mla.io.assets.healing_text_path()`` (the first 30% of the KJV and of the Python docs,
every ~4000-character document of those parts, interleaved by position; ``--data`` after ``--`` for another, e.g.
``mha2mla.train.data.healing.general_data_path()``), far from the held-out slices, a third into each file. The
curve slice: the first 2,048 tokens of each in-domain slice (8 rows of 512). WORK is --work (default ``$MHA2MLA_CACHE/heal``). Training speed side by side: benchmarks/recover_speed.py.
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
from heal_scores import model_scores, ratios, score_table, source_scores

CURVE_TOKENS = 2048
CURVE_SCORE_TOKENS = 4096  # per slice, for each checkpoint of ``curve``


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


def generated_documents(input_ids, tokenizer) -> list[str]:
    """Teacher-generated rows ((N, L) token ids, each starting with its start token) as text documents: each row
    decoded without its start token and cut at every EOS the teacher sampled; empty pieces dropped."""
    eos = tokenizer.eos_token_id
    documents = []
    for row in input_ids.tolist():
        piece: list[int] = []
        for token in [*row[1:], eos]:
            if token == eos:
                text = tokenizer.decode(piece)
                if text.strip():
                    documents.append(text)
                piece = []
            else:
                piece.append(token)
    return documents


def mix(work: Path, generated: Path, seed: int = 0) -> None:
    """WORK/mix-seed<seed>.jsonl: the teacher-generated text cached in ``generated`` (a folder of
    ``mha2mla.train.data.generated`` chunks, from a ``run --no-data`` with ``--teacher``) and the general healing text
    taking turns, one document each, generated first (``mha2mla.train.data.healing.take_turns``)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from mha2mla.train.data.healing import general_data_path, take_turns, write_documents

    chunks = [load_file(str(path)) for path in sorted(generated.glob("chunk-*.safetensors"))]
    ids = torch.cat([chunk["input_ids"] for chunk in chunks])
    tokenizer = AutoTokenizer.from_pretrained(str(harness.source_model()))
    synthetic = generated_documents(ids, tokenizer)
    real = [json.loads(line)["text"] for line in general_data_path(seed).read_text(encoding="utf-8").splitlines()]
    target = write_documents(work / f"mix-seed{seed}.jsonl", take_turns([synthetic, real]))
    print(f"{target}: {len(synthetic)} generated documents ({len(ids)} rows) and {len(real)} real ones, taking turns")


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


def step(converted: str, lr: float, json_out: str | None = None) -> None:
    """How one AdamW-sized step moves the loss, weight kind by weight kind: the first AdamW step moves every entry
    by the learning rate against its gradient's sign, so each kind (q_proj, kv_b_proj, ... over every layer) is
    stepped alone by ``lr`` times the sign of the LM loss's gradient on 4 × 512 tokens of the general healing text,
    the loss measured, the kind put back; the model as converted and with its latents balanced
    (mha2mla.train.model.student.balance_latent_scales, what recover trains)."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.train.data.healing import general_data_path
    from mha2mla.train.model.student import balance_latent_scales

    tokenizer = AutoTokenizer.from_pretrained(converted)
    documents = [json.loads(line)["text"] for line in general_data_path().read_text(encoding="utf-8").splitlines()[:40]]
    ids = tokenizer("\n\n".join(documents), return_tensors="pt").input_ids[:, :2048].reshape(4, 512)
    rows = {}
    for form in ("converted", "balanced"):
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
        if form == "balanced":
            balance_latent_scales(model)
        model(ids, labels=ids).loss.backward()
        kinds: dict[str, list] = {}
        for name, param in model.named_parameters():
            if "layers." in name:
                kinds.setdefault(re.sub(r"model\.layers\.\d+\.", "", name), []).append(param)
        with torch.no_grad():
            rows.setdefault("none", {"kind": "none"})[form] = round(float(model(ids, labels=ids).loss), 4)
            for kind, params in kinds.items():
                kept = [param.detach().clone() for param in params]
                for param in params:
                    param.sub_(lr * param.grad.sign())
                rows.setdefault(kind, {"kind": kind})[form] = round(float(model(ids, labels=ids).loss), 4)
                for param, value in zip(params, kept):
                    param.copy_(value)
    harness.report("heal-step", {"converted": converted, "lr": lr, "tokens": 2048}, list(rows.values()), json_out,
                   columns=["kind", "converted", "balanced"])


def score(work: Path, names: list[str], converted: list[str], json_out: str | None = None,
          num_tokens: int = SLICE_TOKENS, items: int | None = None) -> None:
    """In-domain and unseen-domain scores of the source, of each converted starting point and of each run's output."""
    source = source_scores(work, num_tokens, items)
    rows = []
    for label, folder in [*((Path(c).name, Path(c)) for c in converted), *((n, work / n) for n in names)]:
        row = {"label": label, "scores": model_scores(folder, num_tokens, items=items)}
        row["x_source"] = ratios(row["scores"], source)
        report = folder / "recovery_report.json"
        if report.is_file():
            data = json.loads(report.read_text())
            row.update(tokens=data["tokens_trained"], tokens_per_second=round(data["tokens_per_second"], 1),
                       curve=[(e["tokens"], round(e["perplexity"], 2)) for e in data["evaluations"]])
            walls = work / f"{label}.wall.json"
            if walls.is_file():
                row["wall_seconds"] = sum(json.loads(line)["wall_seconds"] for line in walls.read_text().splitlines())
        rows.append(row)
    harness.report("recovery", {"work": str(work), "slice_tokens": num_tokens, "items": items}, rows, json_out,
                   table=score_table(rows, source, "model"), source_scores=source)


def curve(work: Path, name: str, converted: str, json_out: str | None = None, num_tokens: int = CURVE_SCORE_TOKENS,
          every: int = 1, items: int | None = 0) -> None:
    """The perplexities along run NAME: the converted model it started from, each checkpoint kept in
    WORK/NAME/checkpoints (``--keep-checkpoints N --keep-checkpoints-after-run``) loaded over it, and the run's
    output; the last of these also on the first ``items`` items of the continuation tasks (0: none)."""
    from safetensors.torch import load_file

    source = source_scores(work, num_tokens, items)
    steps = [p for p in sorted((work / name / "checkpoints").glob("step-*")) if int(p.name[5:]) % every == 0]
    points = [("0", converted, None), *((p.name[5:].lstrip("0"), converted, p / "trainable.safetensors") for p in steps)]
    if (work / name / "model.safetensors").is_file():
        points.append(("end", work / name, None))
    rows = []
    for index, (label, folder, state) in enumerate(points):  # the tasks on the last point only
        scores = model_scores(folder, num_tokens, load_file(str(state)) if state else None,
                              items if index == len(points) - 1 else 0)
        rows.append({"label": f"{name} step {label}", "scores": scores, "x_source": ratios(scores, source)})
    harness.report("recovery-curve", {"run": name, "slice_tokens": num_tokens}, rows, json_out,
                   table=score_table(rows, source, "checkpoint"), source_scores=source)


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
    parser.add_argument("step", choices=["prepare", "run", "score", "curve", "mix", "regions", "step"])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--converted", action="append", default=[])
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: $MHA2MLA_CACHE/heal)")
    parser.add_argument("--generated", type=Path, help="mix: a folder of cached teacher-generated chunks")
    parser.add_argument("--no-data", action="store_true", help="no --data: the default healing text")
    parser.add_argument("--slice-tokens", type=int, default=None, help="tokens scored per slice (score: "
                        f"{SLICE_TOKENS}, curve: {CURVE_SCORE_TOKENS})")
    parser.add_argument("--lr", type=float, default=2.5e-4, help="step: the step's size (AdamW's first step "
                        "moves every entry by the learning rate)")
    parser.add_argument("--every", type=int, default=1, help="curve: the checkpoints of every N-th step only")
    parser.add_argument("--items", type=int, default=None, help="score: the first N items of each continuation "
                        "task (score: default all 100; curve: default 0, none)")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.work = args.work or harness.cache_path("heal")
    if args.step == "prepare":
        prepare(args.work)
    elif args.step in ("run", "curve") and (len(args.names) != 1 or len(args.converted) != 1):
        parser.error(f"{args.step} takes one NAME and one --converted")
    elif args.step == "step" and len(args.converted) != 1:
        parser.error("step takes one --converted")
    elif args.step == "step":
        step(args.converted[0], args.lr, args.json_out)
    elif args.step == "run":
        run(args.work, args.names[0], args.converted[0], extra, args.no_data)
    elif args.step == "mix":
        mix(args.work, args.generated) if args.generated else parser.error("mix takes --generated FOLDER")
    elif args.step == "curve":
        curve(args.work, args.names[0], args.converted[0], args.json_out, args.slice_tokens or CURVE_SCORE_TOKENS, args.every,
              args.items or 0)
    elif args.step == "regions":
        regions(args.work, args.names, args.converted, args.json_out)
    else:
        score(args.work, args.names, args.converted, args.json_out, args.slice_tokens or SLICE_TOKENS, args.items)


if __name__ == "__main__":
    sys.exit(harness.run(main))
