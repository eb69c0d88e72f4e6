"""Recovery's memory and speed: the measured peak RSS and tokens/s of real `mha2mla recover` runs, beside the
memory estimate the same settings give (`recover --dry-run`, mha2mla/train/memory.py).

    python benchmarks/recover_memory.py --cases smollm2-full smollm2-full-selective smollm2-full-checkpointed smollm2-lora
    python benchmarks/recover_memory.py --cases smollm2-full smollm2-full-auto --steps 6
    python benchmarks/recover_memory.py --cases smollm2-lora smollm2-lora-checkpointed --steps 8
    python benchmarks/recover_memory.py --cases smollm2-full --steps 6 --baseline-commit f870c13
    python benchmarks/recover_memory.py --cases llama3-8b-lora llama3-70b-lora --steps 2

Every run is the CLI in a child process (``os.wait4`` gives its ``ru_maxrss``, the figure ``/usr/bin/time -v``
prints). The estimate leaves out what the process holds before the run (torch, transformers, peft, accelerate and
the package imported): a child that only imports them measures that, and ``estimate + libraries`` is what is held
against the measured peak. Each run evaluates on its held-out rows at the start, half-way and at the end and saves a
resume checkpoint half-way, as a real run does every ``eval_every`` / ``save_every`` steps: the peak covers those. tokens/s is the
median of the run's own per-step figures (its ``train_log.jsonl``) after the first step.

The SmolLM2 cases train the default 12.5% conversion (``.cache/converted/smollm2-135m-kv0.125``, see
docs/benchmarks.md "Healing") on the healing text, at the healing recipe's shape (4 x 512 tokens, every decoder
layer, LM loss, bf16), with no, selective and full activation checkpointing and with the default (``auto``); ``smollm2-lora`` is LoRA rank 16 in
float32 (what ``auto`` gives LoRA), ``smollm2-lora-checkpointed`` the same with full activation checkpointing. The
7B-70B cases are random-weight sources at the real layer widths (benchmarks/scale.py builds them: 2 layers of
Llama-3-8B, 1 of Llama-3-70B, a 4,096-token vocabulary), converted weight-only at 25% KV and trained with LoRA + KL
0.5 to the source as teacher, 1 x 1,024 tokens. ``--baseline-commit C`` runs every case also from a git worktree of commit C (its own code, this venv), the
two trees alternating, so "today's" speed and memory are measured beside the checkout's in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
CLI = "from mha2mla.cli.main import main; main()"
LIBRARIES = ("import torch, transformers, peft, accelerate; import mha2mla.cli.main, mha2mla.train; "
             "print([l for l in open('/proc/self/status') if l.startswith('VmRSS:')][0].split()[1])")
SMOLLM2 = ["--full-layers", "--batch-size", "4", "--seq-len", "512", "--compute-dtype", "bfloat16",
           "--distill-weight", "0", "--lr", "3e-4"]
CASES = {
    "smollm2-full": [*SMOLLM2, "--activation-checkpointing", "none"],
    "smollm2-full-auto": SMOLLM2,  # the default: auto, which turns full checkpointing on when every layer trains
    "smollm2-full-selective": [*SMOLLM2, "--activation-checkpointing", "selective"],
    "smollm2-full-checkpointed": [*SMOLLM2, "--activation-checkpointing", "full"],
    "smollm2-lora": ["--lora-rank", "16", "--batch-size", "4", "--seq-len", "512", "--compute-dtype", "float32",
                     "--distill-weight", "0", "--activation-checkpointing", "none"],
    "smollm2-lora-checkpointed": ["--lora-rank", "16", "--batch-size", "4", "--seq-len", "512", "--compute-dtype",
                                  "float32", "--distill-weight", "0", "--activation-checkpointing", "full"],
    "llama3-8b-lora": ["--lora-rank", "16", "--batch-size", "1", "--seq-len", "1024", "--distill-weight", "0.5"],
    "llama3-70b-lora": ["--lora-rank", "16", "--batch-size", "1", "--seq-len", "1024", "--distill-weight", "0.5"],
}
SCALE_LAYERS = {"llama3-8b-lora": ("llama3-8b", 2), "llama3-70b-lora": ("llama3-70b", 1)}


def child(command: list[str], tree: Path) -> tuple[int, int, str]:
    """Run ``command`` with ``tree`` first on the import path: (exit code, peak RSS bytes, stdout + stderr)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1", "MHA2MLA_CACHE": str(harness.cache_path())}
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        output.seek(0)
        return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, output.read()


def libraries_rss(tree: Path) -> int:
    code, _, text = child([sys.executable, "-c", LIBRARIES], tree)
    if code:
        raise SystemExit(f"error: importing the libraries from {tree} failed:\n{text[-2000:]}")
    return int(text.strip().splitlines()[-1]) * 1024


def model_and_teacher(case: str, work: Path) -> tuple[Path, Path | None]:
    """The model a case trains (and its teacher): the cached 12.5% conversion, or a random-weight source at real
    widths converted weight-only (built once under ``work``)."""
    if case.startswith("smollm2"):
        converted = harness.cache_path("converted", "smollm2-135m-kv0.125")
        if not (converted / "config.json").is_file():
            raise SystemExit(f"error: {converted} is missing; run `mha2mla convert <the GGUF of make assets> "
                             f"{converted} --kv-budget 0.125` first (docs/benchmarks.md, \"Healing\").")
        return converted, None
    import torch
    from scale import build_source

    shape, layers = SCALE_LAYERS[case]
    source = build_source(shape, layers, 4096, torch.bfloat16, work / f"{shape}-{layers}")
    converted = work / f"{shape}-{layers}-kv0.25"
    if not (converted / "config.json").is_file():
        code, _, text = child([sys.executable, "-c", CLI, "convert", str(source), str(converted), "--calib", "none",
                               "--kv-budget", "0.25"], REPO)
        if code:
            raise SystemExit(f"error: converting {source} failed:\n{text[-2000:]}")
    return converted, source


def estimate_gib(text: str) -> float:
    for line in text.splitlines():
        if line.strip().startswith("total"):
            return float(line.split()[1])
    raise SystemExit(f"error: no estimate in the dry run's output:\n{text[-2000:]}")


def missing_options(case: str, tree: Path) -> list[str]:
    """The options of ``case`` that ``tree``'s recover does not have (a baseline commit may predate some)."""
    _, _, text = child([sys.executable, "-c", CLI, "recover", "--help"], tree)
    return [flag for flag in CASES[case] if flag.startswith("--") and flag not in text]


def run_case(case: str, tree: Path, args, work: Path, libraries: int) -> dict:
    if tree != REPO and (missing := missing_options(case, tree)):
        return {"case": case, "tree": tree.name, "peak GiB": None, "note": f"no {' '.join(missing)} there"}
    model, teacher = model_and_teacher(case, work)
    data = harness.cache_path("text", "healing_balanced.jsonl")
    out = Path(tempfile.mkdtemp(prefix="recover_memory_", dir=work)) / "out"
    half = max(1, args.steps // 2)  # a held-out evaluation and a checkpoint half-way, as a real run has them
    command = [sys.executable, "-c", CLI, "recover", str(model), "--data", str(data), "--out", str(out),
               "--max-steps", str(args.steps), "--eval-every", str(half), "--save-every", str(half), "--no-progress",
               *CASES[case], *(["--teacher", str(teacher)] if teacher is not None else [])]
    estimate = None  # a baseline commit may predate --dry-run
    if tree == REPO:
        code, _, text = child([*command, "--dry-run"], tree)
        if code:
            raise SystemExit(f"error: the dry run of {case} failed:\n{text[-2000:]}")
        estimate = estimate_gib(text)
    code, peak, text = child(command, tree)
    log_lines = (out / "train_log.jsonl").read_text().splitlines() if (out / "train_log.jsonl").is_file() else []
    shutil.rmtree(out.parent)  # the run's model and checkpoints: a 70B-wide layer's are gigabytes
    if code:
        raise SystemExit(f"error: {case} failed:\n{text[-3000:]}")
    rates = [json.loads(line)["tokens_per_second"] for line in log_lines if "tokens_per_second" in line]
    ratio = None if estimate is None else round((estimate + libraries / GIB) / (peak / GIB), 3)
    return {"case": case, "tree": "checkout" if tree == REPO else tree.name, "peak GiB": round(peak / GIB, 2),
            "libraries GiB": round(libraries / GIB, 2), "estimate GiB": estimate, "estimate + libraries / peak": ratio,
            "tokens/s": round(statistics.median(rates[1:] or rates), 1)}


def baseline_tree(commit: str, work: Path) -> Path:
    tree = work / f"tree-{commit}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
    return tree


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["smollm2-full", "smollm2-lora"])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--baseline-commit", help="also run every case from a worktree of this commit, alternating")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every case in every tree (default 1)")
    parser.add_argument("--work", default=None, help="working folder (default: $MHA2MLA_CACHE/recover_memory)")
    harness.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work) if args.work else harness.cache_path("recover_memory")
    work.mkdir(parents=True, exist_ok=True)
    trees = [REPO] + ([baseline_tree(args.baseline_commit, work)] if args.baseline_commit else [])
    libraries = {tree: libraries_rss(tree) for tree in trees}
    rows = []
    for _ in range(args.repeats):
        for case in args.cases:
            for tree in trees:
                rows.append(run_case(case, tree, args, work, libraries[tree]))
                print(json.dumps(rows[-1]), flush=True)
    settings = {"cases": args.cases, "steps": args.steps, "baseline_commit": args.baseline_commit}
    harness.report("recover_memory", settings, rows, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
