"""The converted model's forward + backward (a recovery step's work, without the optimizer) and forward alone (an
evaluation), with transformers' plain ``sdpa`` (the math path, since MLA's value head is narrower than its query/key
head) against ``mha2mla_sdpa`` (the value padded so PyTorch's fused kernel runs; mha2mla/modeling/sdpa.py).

One process, one model, the two implementations alternating on the same batches of the training text::

    OMP_NUM_THREADS=2 python benchmarks/student_attention.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mha2mla.modeling.sdpa import PADDED_SDPA  # noqa: E402
from mha2mla.train.data import pack_token_lists  # noqa: E402
from mha2mla.train.model import load_student, load_tokenizer, make_trainable  # noqa: E402
from scripts import assets  # noqa: E402

IMPLEMENTATIONS = ("sdpa", PADDED_SDPA)


def batches(converted: str, count: int, batch_size: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Packed rows as recovery feeds them: documents back to back, positions restarting at each (a block-diagonal
    causal mask)."""
    tokenizer = load_tokenizer(converted)
    text = assets.healing_text_path().read_text(encoding="utf-8")[: 6 * count * batch_size * seq_len]
    packed = pack_token_lists([tokenizer(text, add_special_tokens=False)["input_ids"]], seq_len,
                              max_rows=count * batch_size)
    return [packed.rows(slice(batch_size * i, batch_size * (i + 1))) for i in range(count)]


def timed(model, batch: dict[str, torch.Tensor], backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        model.zero_grad(set_to_none=True)
        model(**batch, labels=batch["input_ids"], use_cache=False).loss.backward()
    else:
        with torch.no_grad():
            model(**batch, use_cache=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per implementation, after a warm-up")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--converted", default=str(assets.cache_dir() / "converted" / "smollm2-135m-kv0.125-calibrated"))
    args = parser.parse_args()
    model = make_trainable(load_student(args.converted), None, layers=True)  # what `recover --full-layers` trains
    data = batches(args.converted, args.rounds + 1, args.batch_size, args.seq_len)
    results = {(name, mode): [] for name in IMPLEMENTATIONS for mode in ("forward + backward", "forward")}
    for round_, batch in enumerate(data):  # the first round warms up
        for mode in ("forward + backward", "forward"):
            for name in IMPLEMENTATIONS:
                model.set_attn_implementation(name)
                seconds = timed(model, batch, mode == "forward + backward")
                if round_:
                    results[(name, mode)].append(seconds)
    medians = {key: statistics.median(values) for key, values in results.items()}
    print(json.dumps({"threads": torch.get_num_threads(), "rounds": args.rounds, "batch": [args.batch_size, args.seq_len],
                      "seconds": {f"{name}, {mode}": values for (name, mode), values in results.items()}}, indent=2))
    print("\n| measured | plain sdpa (math path): median s | mha2mla_sdpa: median s | plain / padded |\n|---|---:|---:|---:|")
    for mode in ("forward + backward", "forward"):
        plain, padded = medians[("sdpa", mode)], medians[(PADDED_SDPA, mode)]
        print(f"| {mode}, {args.batch_size} x {args.seq_len} tokens | {plain:.2f} | {padded:.2f} | x{plain / padded:.2f} |")


if __name__ == "__main__":
    main()
