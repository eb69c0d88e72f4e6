"""Training speed of a converted MLA model vs its source under the same LoRA settings, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/recover_speed.py                                   # SmolLM2 12.5% KV
    python benchmarks/recover_speed.py --converted PATH --source PATH_OR_GGUF --seq-len 512 --batch-size 4

LoRA of the same rank on q_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj (converted; kv_a_layernorm trainable as in
`mha2mla recover`) and on q_proj/k_proj/v_proj/o_proj (source). Each timed step is `mha2mla recover`'s own
``RecoveryRun.train_step`` (forward, LM loss, backward, gradient clipping, AdamW, scheduler; no teacher), on
the same packed rows of real text; the two models alternate step by step so both see the same machine load.
Prints JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("MHA2MLA_CACHE", str(REPO / ".cache"))

# after sys.path and MHA2MLA_CACHE are set
import torch  # noqa: E402

from mha2mla.train import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS, LoraSettings, RecoverConfig  # noqa: E402
from mha2mla.train.data import pack_token_lists  # noqa: E402
from mha2mla.train.model import load_student, load_teacher, load_tokenizer, make_trainable  # noqa: E402
from mha2mla.train.run import RecoveryRun  # noqa: E402
from scripts import assets  # noqa: E402


def timed_step(recipe: RecoveryRun, batch: dict[str, torch.Tensor]) -> float:
    """Seconds of one ``train_step`` (the GPU is synchronised on both sides)."""
    cuda = recipe.accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    recipe.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", default=str(assets.cache_dir() / "converted" / "smollm2-135m-kv0.125"))
    parser.add_argument("--source", default=None, help="source folder or .gguf (default: the SmolLM2 GGUF)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    source = args.source or str(assets.default_model_gguf())
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # read when the recipe starts accelerate

    tokenizer = load_tokenizer(args.converted)
    text_path = assets.kjv_text_path()
    text = text_path.read_text(encoding="utf-8")[:200_000]  # training region, not the held-out slice
    needed = args.batch_size * (args.steps + 1)
    packed = pack_token_lists([tokenizer(text, add_special_tokens=False)["input_ids"]], args.seq_len, max_rows=needed)
    batches = [packed.rows(slice(i * args.batch_size, (i + 1) * args.batch_size)) for i in range(args.steps + 1)]

    # the timed steps' settings (nothing is read from data or written to out: only train_step runs)
    config = RecoverConfig(
        model=args.converted, data=[str(text_path)], out=str(assets.cache_dir() / "recover_speed"),
        max_steps=args.steps + 1, seq_len=args.seq_len, batch_size=args.batch_size, learning_rate=1e-4,
        lora=LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank), attn_implementation=args.attn_implementation,
        mixed_precision="bf16" if args.device.startswith("cuda") else "no",
    )
    entries = {}
    for label, loader, targets in (
        ("converted (MLA)", lambda: load_student(args.converted, args.attn_implementation), MLA_LORA_TARGETS),
        ("source (MHA/GQA)", lambda: load_teacher(source, args.attn_implementation), SOURCE_LORA_TARGETS),
    ):
        recipe = RecoveryRun(config, show_progress=False)
        recipe.setup_training(make_trainable(loader(), config.lora.model_copy(update={"targets": targets})))
        recipe.model.train()
        trainable, total = recipe.parameter_counts
        entries[label] = {"recipe": recipe, "seconds": 0.0, "trainable_parameters": trainable, "total_parameters": total}

    for entry in entries.values():  # warm-up
        timed_step(entry["recipe"], batches[0])
    for batch in batches[1:]:  # alternate so both models see the same load
        for entry in entries.values():
            entry["seconds"] += timed_step(entry["recipe"], batch)

    tokens = args.steps * args.batch_size * args.seq_len
    results = []
    for label, entry in entries.items():
        results.append({"model": label, "tokens_per_second": tokens / entry["seconds"],
                        "trainable_parameters": entry["trainable_parameters"], "total_parameters": entry["total_parameters"]})
    ratio = results[0]["tokens_per_second"] / results[1]["tokens_per_second"]
    device = entries["converted (MLA)"]["recipe"].accelerator.device
    print(json.dumps({"device": str(device), "threads": torch.get_num_threads(), "seq_len": args.seq_len,
                      "batch_size": args.batch_size, "timed_tokens_per_model": tokens, "lora_rank": args.lora_rank,
                      "attn_implementation": args.attn_implementation, "results": results,
                      "converted_over_source": ratio}, indent=2))
    print("\n| model | LoRA targets | trainable params | training tokens/s |\n|---|---|---|---|")
    targets = {"converted (MLA)": ",".join(MLA_LORA_TARGETS) + " (+kv_a_layernorm)", "source (MHA/GQA)": ",".join(SOURCE_LORA_TARGETS)}
    for row in results:
        print(f"| {row['model']} | {targets[row['model']]} | {row['trainable_parameters']:,} | {row['tokens_per_second']:.1f} |")
    print(f"\nconverted / source: {ratio:.2f}x")


if __name__ == "__main__":
    main()
