"""Held-out perplexity after an equal number of training tokens, float32 vs bfloat16 (``mha2mla recover
--compute-dtype``): the same recovery (same data order, seed, schedule and LoRA initialisation) once per compute
dtype, then every run's merged output scored in float32 on the same held-out rows. Acceptance (issue #26): the
bfloat16 run's perplexity within 2% of the float32 run's.

    OMP_NUM_THREADS=2 python benchmarks/recover_curve.py --converted PATH --tokens 40960      # both, one after the other
    python benchmarks/recover_curve.py --converted PATH --compute-dtypes float32               # or one per process,
    python benchmarks/recover_curve.py --converted PATH --compute-dtypes bfloat16              # in parallel,
    python benchmarks/recover_curve.py --converted PATH                                        # then the summary

A finished run (WORK/out-<dtype>) is reused and an interrupted one resumed, so the last command only scores and
compares. Training text: the first 30% of the KJV and of the Python docs, ~4000-character documents interleaved;
held out: ``held_out_token_ids`` of the KJV (1/3 into the file, far from the training region). Besides the final
scores it prints each run's own curve (evaluated in its compute dtype) and its training tokens/s (runs one after the
other see different loads: benchmarks/recover_speed.py is the speed comparison). WORK is --work (default
``$MHA2MLA_CACHE/recover_curve``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("MHA2MLA_CACHE", str(REPO / ".cache"))

# after sys.path and MHA2MLA_CACHE are set
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from mha2mla.train import LoraSettings, RecoverConfig, recover  # noqa: E402
from mha2mla.train.data import build_packed  # noqa: E402
from mha2mla.train.distributed import start_accelerator  # noqa: E402
from mha2mla.train.evaluate import packed_perplexity  # noqa: E402
from mha2mla.train.model import load_tokenizer  # noqa: E402
from scripts import assets  # noqa: E402
from scripts.assets import HEALING_FRACTION as TRAIN_FRACTION  # noqa: E402  the healing text's split
from scripts.assets import _documents  # noqa: E402

TOLERANCE = 0.02


def prepare(work: Path, converted: str, eval_tokens: int) -> None:
    """WORK/train.jsonl and WORK/eval_kjv.txt, once."""
    if (work / "train.jsonl").is_file() and (work / "eval_kjv.txt").is_file():
        return
    work.mkdir(parents=True, exist_ok=True)
    parts = []
    for name in ("kjv", "python_docs"):
        text = assets.held_out_text_path(name).read_text(encoding="utf-8")
        parts.append(_documents(text[: text.rfind("\n", 0, int(len(text) * TRAIN_FRACTION)) + 1]))
    with open(work / "train.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": doc}) + "\n" for pair in zip(*parts) for doc in pair)
    tokenizer = load_tokenizer(converted)
    ids = assets.held_out_token_ids(tokenizer, "kjv", eval_tokens)
    (work / "eval_kjv.txt").write_text(tokenizer.decode(ids), encoding="utf-8")


def train(args, compute: str) -> Path:
    """The recovery in ``compute`` (WORK/out-<dtype>), skipped when finished, resumed when interrupted."""
    out = args.work / f"out-{compute}"
    if (out / "recovery_report.json").is_file():
        return out
    config = RecoverConfig(
        model=args.converted, data=[str(args.work / "train.jsonl")], out=str(out), compute_dtype=compute,
        eval_data=[str(args.work / "eval_kjv.txt")], eval_sequences=args.eval_tokens // args.seq_len,
        seq_len=args.seq_len, batch_size=args.batch_size, max_tokens=args.tokens, learning_rate=args.lr,
        warmup_steps=5, lora=LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
        eval_every=args.eval_every, save_every=args.eval_every,
    )
    recover(config, resume="auto" if out.exists() else None)
    return out


def score(args, outs: dict[str, Path]) -> dict[str, float]:
    """Held-out perplexity of every merged output, in float32 (no autocast), on the same rows."""
    accelerator = start_accelerator("no")
    rows = build_packed(load_tokenizer(args.converted), [str(args.work / "eval_kjv.txt")], args.seq_len,
                        max_rows=args.eval_tokens // args.seq_len)
    scores = {}
    for compute, out in outs.items():
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(accelerator.device).eval()
        scores[compute] = packed_perplexity(model, rows, args.batch_size, accelerator)
        del model
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", default=str(assets.cache_dir() / "converted" / "smollm2-135m-kv0.125"))
    parser.add_argument("--work", type=Path, default=assets.cache_dir() / "recover_curve")
    parser.add_argument("--compute-dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=40960, help="training tokens per run")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-rank", type=int, default=32)
    args = parser.parse_args()
    prepare(args.work, args.converted, args.eval_tokens)
    outs = {compute: train(args, compute) for compute in args.compute_dtypes}
    outs.update({compute: args.work / f"out-{compute}" for compute in ("float32", "bfloat16")
                 if (args.work / f"out-{compute}" / "recovery_report.json").is_file()})
    reports = {compute: json.loads((out / "recovery_report.json").read_text()) for compute, out in outs.items()}
    scores = score(args, outs)
    result = {"tokens": args.tokens, "seq_len": args.seq_len, "eval_tokens": args.eval_tokens,
              "held_out_perplexity_float32_scoring": scores,
              "curves": {c: [(e["tokens"], round(e["perplexity"], 3)) for e in r["evaluations"]] for c, r in reports.items()},
              "train_tokens_per_second": {c: round(r["tokens_per_second"], 1) for c, r in reports.items()}}
    if {"float32", "bfloat16"} <= set(scores):
        result["bfloat16_over_float32"] = scores["bfloat16"] / scores["float32"]
        result["within_2_percent"] = abs(result["bfloat16_over_float32"] - 1) <= TOLERANCE
    print(json.dumps(result, indent=2))
    print("\n| compute dtype | training tokens | held-out KJV ppl (scored in float32) | training tokens/s |\n|---|---|---|---|")
    for compute, value in scores.items():
        print(f"| {compute} | {reports[compute]['tokens_trained']:,} | {value:.3f} | {reports[compute]['tokens_per_second']:.1f} |")
    if "bfloat16_over_float32" in result:
        print(f"\nbfloat16 / float32 perplexity: {result['bfloat16_over_float32']:.4f} (within 2%: {result['within_2_percent']})")


if __name__ == "__main__":
    main()
