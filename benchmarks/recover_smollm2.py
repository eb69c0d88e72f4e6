"""Recovery of SmolLM2-135M converted at 12.5% KV: LM-only vs distillation at the same token count, with the
held-out KJV perplexity curve, next to the source model and the training-free conversion.

    OMP_NUM_THREADS=1 python benchmarks/recover_smollm2.py prepare --eval-tokens 8192
    OMP_NUM_THREADS=1 python benchmarks/recover_smollm2.py train --mode lm      --tokens 40960   # (in parallel:)
    OMP_NUM_THREADS=1 python benchmarks/recover_smollm2.py train --mode distill --tokens 40960
    OMP_NUM_THREADS=1 python benchmarks/recover_smollm2.py summary             # JSON + Markdown table

Training text: the first 30% of the KJV and of the Python docs (cut into ~4000-character documents at line
boundaries, the two sources interleaved), far from the held-out slices (which start 1/3 into each file).
Evaluation: ``held_out_token_ids(tokenizer, name, N)`` decoded to text and packed into rows of --seq-len.
RECOVER_CONVERTED (the converted checkpoint) and RECOVER_WORK (the run folder) override the defaults.
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
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from mha2mla.train import LoraSettings, RecoverConfig, recover  # noqa: E402
from mha2mla.train.data import build_packed  # noqa: E402
from mha2mla.train.evaluate import packed_perplexity  # noqa: E402
from mha2mla.train.model import load_teacher  # noqa: E402
from scripts import assets  # noqa: E402
from scripts.assets import HEALING_FRACTION as TRAIN_FRACTION  # noqa: E402  the healing text's split
from scripts.assets import _documents  # noqa: E402

CONVERTED = Path(os.environ.get("RECOVER_CONVERTED", assets.cache_dir() / "converted" / "smollm2-135m-kv0.125"))
WORK = Path(os.environ.get("RECOVER_WORK", assets.cache_dir() / "recover_smollm2"))


def prepare(eval_tokens: int) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    parts = []
    for name in ("kjv", "python_docs"):
        text = assets.held_out_text_path(name).read_text(encoding="utf-8")
        cut = text.rfind("\n", 0, int(len(text) * TRAIN_FRACTION)) + 1
        parts.append(_documents(text[:cut]))
    interleaved = [doc for pair in zip(*parts) for doc in pair]
    with open(WORK / "train.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": doc}) + "\n" for doc in interleaved)
    tokenizer = AutoTokenizer.from_pretrained(CONVERTED)
    for name in ("kjv", "python_docs"):
        ids = assets.held_out_token_ids(tokenizer, name, eval_tokens)
        (WORK / f"eval_{name}.txt").write_text(tokenizer.decode(ids), encoding="utf-8")
    print(f"wrote {len(interleaved)} training documents and held-out slices of {eval_tokens} tokens to {WORK}")


def train(mode: str, tokens: int, seq_len: int, eval_sequences: int, eval_every: int, lr: float, rank: int) -> None:
    config = RecoverConfig(
        model=str(CONVERTED), data=[str(WORK / "train.jsonl")], out=str(WORK / f"out-{mode}"),
        teacher=str(assets.default_model_gguf()) if mode == "distill" else None,
        eval_data=[str(WORK / "eval_kjv.txt")], eval_sequences=eval_sequences, seq_len=seq_len, batch_size=4,
        max_tokens=tokens, learning_rate=lr, warmup_steps=5, lora=LoraSettings(rank=rank, alpha=2.0 * rank),
        eval_every=eval_every, save_every=eval_every, distill_weight=0.5, temperature=1.0,
    )
    report = recover(config, resume="auto")
    print(json.dumps({k: report[k] for k in ("steps", "tokens_trained", "final_loss", "tokens_per_second", "evaluations")}))


def summary(seq_len: int, eval_sequences: int) -> None:
    accelerator = Accelerator(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(CONVERTED)
    held_out = {name: build_packed(tokenizer, [str(WORK / f"eval_{name}.txt")], seq_len, max_rows=eval_sequences)
                for name in ("kjv", "python_docs")}
    models = {"source (GGUF, MHA/GQA)": None, "converted 12.5% KV (no training)": CONVERTED}
    runs = {}
    for mode in ("lm", "distill"):
        out = WORK / f"out-{mode}"
        if (out / "recovery_report.json").is_file():
            models[f"recovered: {'LM loss' if mode == 'lm' else 'LM + distillation'}"] = out
            runs[mode] = json.loads((out / "recovery_report.json").read_text())
    rows = []
    for label, folder in models.items():
        model = load_teacher(str(assets.default_model_gguf())) if folder is None else \
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        result = {"model": label}
        for name, rows_ in held_out.items():
            result[name] = packed_perplexity(model, rows_, 4, accelerator)
        rows.append(result)
        del model
    source = rows[0]
    for row in rows:
        row["kjv_x_source"] = row["kjv"] / source["kjv"]
        row["python_docs_x_source"] = row["python_docs"] / source["python_docs"]
    curves = {mode: [(e["tokens"], round(e["perplexity"], 3)) for e in run["evaluations"]] for mode, run in runs.items()}
    speeds = {mode: round(run["tokens_per_second"], 1) for mode, run in runs.items()}
    print(json.dumps({"seq_len": seq_len, "eval_tokens": seq_len * eval_sequences, "perplexity": rows,
                      "curves": curves, "train_tokens_per_second": speeds}, indent=2))
    print("\n| model | KJV ppl | x source | Python docs ppl | x source |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['kjv']:.2f} | {row['kjv_x_source']:.2f} | {row['python_docs']:.2f} | "
              f"{row['python_docs_x_source']:.2f} |")
    for mode, curve in curves.items():
        print(f"\n{mode} curve (training tokens -> held-out KJV ppl): " + ", ".join(f"{t}: {p}" for t, p in curve))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["prepare", "train", "summary"])
    parser.add_argument("--mode", choices=["lm", "distill"], default="lm")
    parser.add_argument("--tokens", type=int, default=40960)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-rank", type=int, default=32)
    args = parser.parse_args()
    eval_sequences = args.eval_tokens // args.seq_len
    if args.step == "prepare":
        prepare(args.eval_tokens)
    elif args.step == "train":
        train(args.mode, args.tokens, args.seq_len, eval_sequences, args.eval_every, args.lr, args.lora_rank)
    else:
        summary(args.seq_len, eval_sequences)


if __name__ == "__main__":
    main()
