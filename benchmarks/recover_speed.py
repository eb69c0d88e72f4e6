"""Training speed of a converted MLA model vs its source under the same LoRA settings, in float32 and in bfloat16
(``mha2mla recover --compute-dtype``), side by side in one run.

    OMP_NUM_THREADS=2 python benchmarks/recover_speed.py --converted PATH --compute-dtypes float32 bfloat16 --steps 8
    python benchmarks/recover_speed.py --converted PATH --source PATH_OR_GGUF --seq-len 512 --batch-size 4
    python benchmarks/recover_speed.py --converted PATH --models converted --compute-dtypes float32 bfloat16

PATH is a converted model (``mha2mla convert``; the default is the SmolLM2 12.5% KV conversion in the cache), the
source defaults to the SmolLM2 GGUF. LoRA of the same rank on q_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj
(converted; kv_a_layernorm trainable as in `mha2mla recover`) and on q_proj/k_proj/v_proj/o_proj (source). Each
timed step is `mha2mla recover`'s own ``RecoveryRun.train_step`` (forward, LM loss, backward, gradient clipping,
AdamW, scheduler; no teacher) in the run's compute dtype, on the same packed rows of real text; every (model,
compute dtype) pair takes one step in turn so all see the same machine load. Prints JSON and a Markdown table:
training tokens/s per pair, bfloat16 / float32 per model and converted / source per compute dtype.

Held-out perplexity after equal tokens in float32 and bfloat16: benchmarks/recover_curve.py.
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


COMPUTE_ORDER = ("float32", "auto", "bfloat16")  # no-autocast runs start accelerate first (distributed.start_accelerator)


def build_entries(args, source: str, config: RecoverConfig) -> dict[tuple[str, str], dict]:
    """One prepared ``RecoveryRun`` per (model, compute dtype), keyed by the model's label and the resolved dtype."""
    loaders = {
        "converted": ("converted (MLA)", lambda: load_student(args.converted, args.attn_implementation), MLA_LORA_TARGETS),
        "source": ("source (MHA/GQA)", lambda: load_teacher(source, args.attn_implementation), SOURCE_LORA_TARGETS),
    }
    entries = {}
    for compute in sorted(set(args.compute_dtypes), key=COMPUTE_ORDER.index):
        for model in args.models:
            label, loader, targets = loaders[model]
            recipe = RecoveryRun(config.model_copy(update={"compute_dtype": compute}), show_progress=False)
            recipe.setup_training(make_trainable(loader(), config.lora.model_copy(update={"targets": targets})))
            recipe.model.train()
            trainable, total = recipe.parameter_counts
            if (label, recipe.compute_dtype) in entries:  # auto named beside the dtype it resolves to
                continue
            entries[(label, recipe.compute_dtype)] = {"recipe": recipe, "seconds": 0.0, "trainable_parameters": trainable,
                                                      "total_parameters": total}
    return entries


def ratios(speed: dict[tuple[str, str], float]) -> dict[str, float]:
    """bfloat16 / float32 per model and converted / source per compute dtype, where both were timed."""
    found = {}
    for label in {label for label, _ in speed}:
        if (label, "bfloat16") in speed and (label, "float32") in speed:
            found[f"{label}: bfloat16 / float32"] = speed[(label, "bfloat16")] / speed[(label, "float32")]
    for compute in {compute for _, compute in speed}:
        pair = (("converted (MLA)", compute), ("source (MHA/GQA)", compute))
        if all(key in speed for key in pair):
            found[f"{compute}: converted / source"] = speed[pair[0]] / speed[pair[1]]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", default=str(assets.cache_dir() / "converted" / "smollm2-135m-kv0.125"))
    parser.add_argument("--source", default=None, help="source folder or .gguf (default: the SmolLM2 GGUF)")
    parser.add_argument("--models", nargs="+", choices=["converted", "source"], default=["converted", "source"])
    parser.add_argument("--compute-dtypes", nargs="+", choices=COMPUTE_ORDER, default=["float32", "bfloat16"],
                        help="compute dtypes timed side by side (auto: what `mha2mla recover` picks here)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per (model, compute dtype), after one warm-up")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    source = args.source or ("" if args.models == ["converted"] else str(assets.default_model_gguf()))
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
    )
    entries = build_entries(args, source, config)
    for entry in entries.values():  # warm-up
        timed_step(entry["recipe"], batches[0])
    for batch in batches[1:]:  # in turn, so every pair sees the same load
        for entry in entries.values():
            entry["seconds"] += timed_step(entry["recipe"], batch)

    tokens = args.steps * args.batch_size * args.seq_len
    speed = {key: tokens / entry["seconds"] for key, entry in entries.items()}
    results = [{"model": label, "compute_dtype": compute, "tokens_per_second": speed[(label, compute)],
                "trainable_parameters": entry["trainable_parameters"], "total_parameters": entry["total_parameters"]}
               for (label, compute), entry in entries.items()]
    found = ratios(speed)
    device = next(iter(entries.values()))["recipe"].accelerator.device
    print(json.dumps({"device": str(device), "threads": torch.get_num_threads(), "seq_len": args.seq_len,
                      "batch_size": args.batch_size, "timed_tokens_per_pair": tokens, "lora_rank": args.lora_rank,
                      "attn_implementation": args.attn_implementation, "results": results, "ratios": found}, indent=2))
    print("\n| model | compute dtype | LoRA targets | trainable params | training tokens/s |\n|---|---|---|---|---|")
    targets = {"converted (MLA)": ",".join(MLA_LORA_TARGETS) + " (+kv_a_layernorm)", "source (MHA/GQA)": ",".join(SOURCE_LORA_TARGETS)}
    for row in results:
        print(f"| {row['model']} | {row['compute_dtype']} | {targets[row['model']]} | {row['trainable_parameters']:,} | "
              f"{row['tokens_per_second']:.1f} |")
    for name, value in found.items():
        print(f"\n{name}: {value:.2f}x", end="")
    print()


if __name__ == "__main__":
    main()
