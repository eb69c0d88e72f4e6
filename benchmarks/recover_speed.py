"""Recovery, the speed and memory: training tokens/s of a converted MLA model vs its source under the same LoRA
settings, in float32 and in bfloat16 (``mha2mla recover --compute-dtype``), side by side in one run.

    OMP_NUM_THREADS=2 python benchmarks/recover_speed.py --converted PATH --compute-dtypes float32 bfloat16 --steps 8
    python benchmarks/recover_speed.py --converted PATH --source PATH_OR_GGUF --seq-len 512 --batch-size 4
    python benchmarks/recover_speed.py --converted PATH --models converted --compute-dtypes float32 bfloat16

PATH is a converted model (``mha2mla convert``; the default is the SmolLM2 12.5% KV conversion in the cache), the
source defaults to the SmolLM2 GGUF. LoRA of the same rank on q_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj
(converted; kv_a_layernorm trainable as in `mha2mla recover`) and on q_proj/k_proj/v_proj/o_proj (source). Each
timed step is `mha2mla recover`'s own ``RecoveryRun.train_step`` (forward, LM loss, backward, gradient clipping,
AdamW, scheduler; no teacher) in the run's compute dtype, on the same packed rows of real text; every (model,
compute dtype) pair takes one step in turn so all see the same machine load. Prints the JSON record
(benchmarks/harness.py) and a Markdown table: training tokens/s per pair, bfloat16 / float32 per model and
converted / source per compute dtype, and the process's peak memory (peak RSS; on CUDA, each pair's peak allocated).

The curve (held-out perplexity along a run) and the score of its output: benchmarks/heal.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import harness

COMPUTE_ORDER = ("float32", "auto", "bfloat16")  # no-autocast runs start accelerate first (devices.start_devices)


def build_entries(args, source: str, config) -> dict[tuple[str, str], dict]:
    """One prepared ``RecoveryRun`` per (model, compute dtype), keyed by the model's label and the resolved dtype."""
    from mha2mla.train import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS
    from mha2mla.train.devices import start_devices
    from mha2mla.train.loop import RecoveryRun
    from mha2mla.train.model.student import load_student
    from mha2mla.train.model.teacher import load_teacher
    from mha2mla.train.model.trainable import make_trainable

    loaders = {
        "converted": ("converted (MLA)", lambda: load_student(args.converted, args.attn_implementation), MLA_LORA_TARGETS),
        "source": ("source (MHA/GQA)", lambda: load_teacher(source, args.attn_implementation), SOURCE_LORA_TARGETS),
    }
    entries = {}
    for compute in sorted(set(args.compute_dtypes), key=COMPUTE_ORDER.index):
        for model in args.models:
            label, loader, targets = loaders[model]
            settings = config.model_copy(update={"compute_dtype": compute})
            recipe = RecoveryRun(settings, start_devices(settings), settings.total_steps())
            recipe.setup_training(make_trainable(loader(), config.lora.model_copy(update={"targets": targets})))
            recipe.model.train()
            trainable, total = recipe.parameter_counts
            if (label, recipe.compute_dtype) in entries:  # auto named beside the dtype it resolves to
                continue
            entries[(label, recipe.compute_dtype)] = {"recipe": recipe, "trainable_parameters": trainable,
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", default=None, help="converted model (default: the cache's converted/smollm2-135m-kv0.125)")
    parser.add_argument("--source", default=None, help="source folder or .gguf (default: the cached SmolLM2 GGUF)")
    parser.add_argument("--models", nargs="+", choices=["converted", "source"], default=["converted", "source"])
    parser.add_argument("--compute-dtypes", nargs="+", choices=COMPUTE_ORDER, default=["float32", "bfloat16"],
                        help="compute dtypes timed side by side (auto: what `mha2mla recover` picks here)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per (model, compute dtype), after one warm-up")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.converted = args.converted or str(harness.cache_path("converted", "smollm2-135m-kv0.125"))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def training_rows(args):
    """(the RecoverConfig of the timed steps, warm-up + timed batches of packed KJV rows from the training region)."""
    from mha2mla.io.cache import cached_held_out_text
    from mha2mla.train import LoraSettings, RecoverConfig
    from mha2mla.train.data.packing import pack_token_lists
    from mha2mla.train.model.teacher import load_tokenizer

    tokenizer = load_tokenizer(args.converted)
    text_path = cached_held_out_text("kjv")
    text = text_path.read_text(encoding="utf-8")[:200_000]  # training region, not the held-out slice
    needed = args.batch_size * (args.steps + 1)
    packed = pack_token_lists([tokenizer(text, add_special_tokens=False)["input_ids"]], args.seq_len, max_rows=needed)
    batches = [packed.rows(slice(i * args.batch_size, (i + 1) * args.batch_size)) for i in range(args.steps + 1)]
    # nothing is read from data or written to out: only train_step runs
    config = RecoverConfig(
        model=args.converted, data=[str(text_path)], out=str(harness.cache_path("recover_speed")),
        max_steps=args.steps + 1, seq_len=args.seq_len, batch_size=args.batch_size, learning_rate=1e-4,
        lora=LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank), attn_implementation=args.attn_implementation,
    )
    return config, batches


def main(argv=None) -> int:
    from mha2mla.io.cache import cached_default_model
    from mha2mla.train import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS

    args = parse_args(argv)
    import torch  # after the arguments: --help stays quick

    source = args.source or ("" if args.models == ["converted"] else str(cached_default_model()))
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # read when the recipe starts accelerate
    config, batches = training_rows(args)
    entries = build_entries(args, source, config)
    cuda = args.device == "cuda"

    def step(entry: dict):
        def call(round_: int) -> None:  # round 0 warms up on batch 0, then one batch per round
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            entry["recipe"].train_step(batches[round_])
            if cuda:
                entry["peak_gib"] = max(entry.get("peak_gib", 0.0), torch.cuda.max_memory_allocated() / 2**30)
        return call

    times = harness.time_side_by_side({key: step(entry) for key, entry in entries.items()}, repeats=args.steps,
                                      warmup=1, synchronize=torch.cuda.synchronize if cuda else None)
    tokens = args.steps * args.batch_size * args.seq_len
    speed = {key: tokens / sum(times[key]) for key in entries}
    targets = {"converted (MLA)": ",".join(MLA_LORA_TARGETS) + " (+kv_a_layernorm)", "source (MHA/GQA)": ",".join(SOURCE_LORA_TARGETS)}
    results = [{"model": label, "compute_dtype": compute, "lora_targets": targets[label],
                "trainable_parameters": entry["trainable_parameters"], "total_parameters": entry["total_parameters"],
                "tokens_per_second": round(speed[(label, compute)], 1),
                "peak_gpu_gib": round(entry["peak_gib"], 2) if "peak_gib" in entry else None}
               for (label, compute), entry in entries.items()]
    device = next(iter(entries.values()))["recipe"].accelerator.device
    settings = {"device": str(device), "seq_len": args.seq_len, "batch_size": args.batch_size,
                "timed_tokens_per_pair": tokens, "lora_rank": args.lora_rank, "attn_implementation": args.attn_implementation}
    found = {name: round(value, 3) for name, value in ratios(speed).items()}
    table = harness.markdown_table(results, ["model", "compute_dtype", "lora_targets", "trainable_parameters",
                                             "tokens_per_second", "peak_gpu_gib"])
    table += "".join(f"\n\n{name}: {value:.2f}x" for name, value in found.items())
    table += f"\n\npeak RSS of the process (every pair loaded): {harness.peak_rss_mib():,.0f} MiB"
    harness.report("recovery-speed", settings, results, args.json_out, table=table, ratios=found,
                   peak_rss_mib=harness.peak_rss_mib())
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
