"""Training speed of a converted MLA model vs its source under the same LoRA settings, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/recover_speed.py                                   # SmolLM2 12.5% KV
    python benchmarks/recover_speed.py --converted PATH --source PATH_OR_GGUF --seq-len 512 --batch-size 4

LoRA of the same rank on q_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj (converted; kv_a_layernorm trainable as in
`mha2mla recover`) and on q_proj/k_proj/v_proj/o_proj (source). Each timed step is forward + backward + AdamW
on the same packed rows of real text; the two models alternate step by step so both see the same machine load.
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


def main() -> None:
    import torch

    from mha2mla.data import assets
    from mha2mla.train import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS, RecoverConfig
    from mha2mla.train.data import pack_token_lists, target_mask
    from mha2mla.train.losses import lm_loss
    from mha2mla.train.model import (
        count_parameters,
        load_student,
        load_teacher,
        load_tokenizer,
        make_trainable,
    )

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
    device = torch.device(args.device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    tokenizer = load_tokenizer(args.converted)
    text = assets.kjv_text_path().read_text(encoding="utf-8")[:200_000]  # training region, not the held-out slice
    needed = args.batch_size * (args.steps + 1)
    packed = pack_token_lists([tokenizer(text, add_special_tokens=False)["input_ids"]], args.seq_len, max_rows=needed)
    batches = [packed.rows(slice(i * args.batch_size, (i + 1) * args.batch_size)) for i in range(args.steps + 1)]

    def lora(targets, norms):
        config = RecoverConfig(model=args.converted, data=["-"], out="-", max_steps=1, lora_rank=args.lora_rank,
                               lora_alpha=2.0 * args.lora_rank, lora_targets=targets)
        return config, norms

    entries = {}
    for label, loader, (config, norms) in (
        ("converted (MLA)", lambda: load_student(args.converted, args.attn_implementation), lora(MLA_LORA_TARGETS, None)),
        ("source (MHA/GQA)", lambda: load_teacher(source, args.attn_implementation), lora(SOURCE_LORA_TARGETS, ())),
    ):
        model = make_trainable(loader(), config, norms=norms).to(device)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        trainable, total = count_parameters(model)
        entries[label] = {"model": model, "optimizer": optimizer, "seconds": 0.0, "trainable_parameters": trainable,
                          "total_parameters": total}

    def step(entry, batch) -> float:
        batch = {k: v.to(device) for k, v in batch.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with autocast:
            logits = entry["model"](**batch, use_cache=False).logits
            loss = lm_loss(logits, batch["input_ids"], target_mask(batch["position_ids"]))
        loss.backward()
        entry["optimizer"].step()
        entry["optimizer"].zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for entry in entries.values():  # warm-up
        step(entry, batches[0])
    for batch in batches[1:]:  # alternate so both models see the same load
        for entry in entries.values():
            entry["seconds"] += step(entry, batch)

    tokens = args.steps * args.batch_size * args.seq_len
    results = []
    for label, entry in entries.items():
        results.append({"model": label, "tokens_per_second": tokens / entry["seconds"],
                        "trainable_parameters": entry["trainable_parameters"], "total_parameters": entry["total_parameters"]})
    ratio = results[0]["tokens_per_second"] / results[1]["tokens_per_second"]
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
