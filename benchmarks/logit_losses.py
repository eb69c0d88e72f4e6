"""The recovery losses in one chunked pass (mha2mla.train.losses.logit_losses) against the whole-tensor formulas
they replaced, side by side in one process, one variant after the other on the same inputs:

    OMP_NUM_THREADS=2 python benchmarks/logit_losses.py --repeats 5 --steps 3

1. loss only: LM + 0.5 KL (temperature 1) on random float32 logits of (batch, seq, vocab) = (4, 512, 49,152), SmolLM2's
   recovery shape; forward and backward, ``--repeats`` times per variant in turn.
2. a real train step: `mha2mla recover`'s ``RecoveryRun.train_step`` on the SmolLM2-135M 12.5% KV conversion with
   ``--full-layers``, the GGUF teacher, KL weight 0.5, float32, batch 4 of 512 tokens of the healing text; ``--steps``
   per variant in turn after one warm-up each (``--steps 0`` skips this part).

For each: median seconds and the peak resident memory above what was resident before (Linux VmHWM, reset through
/proc/self/clear_refs before every measurement). Prints JSON and a Markdown table with the whole-tensor / one-pass
ratios (docs/benchmarks.md, "Losses in one pass").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("MHA2MLA_CACHE", str(REPO / ".cache"))
os.environ["ACCELERATE_USE_CPU"] = "1"

# after sys.path and MHA2MLA_CACHE are set
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mha2mla.train import RecoverConfig  # noqa: E402
from mha2mla.train import run as run_module  # noqa: E402
from mha2mla.train.data import pack_token_lists  # noqa: E402
from mha2mla.train.losses import logit_losses  # noqa: E402
from mha2mla.train.model import load_student, load_teacher, load_tokenizer, make_trainable  # noqa: E402
from scripts import assets  # noqa: E402


def whole_tensor_losses(logits, teacher_logits, input_ids, mask, lm_weight=1.0, kl_weight=0.0, temperature=1.0):
    """The formulas before the one-pass version (the baseline): cross-entropy and KL on whole (B, L-1, V) float32
    tensors through autograd, every intermediate kept for the backward pass."""
    weights = mask.reshape(-1).float()
    shifted = logits[:, :-1].float()
    nll = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none")
    lm = (nll * weights).sum() / weights.sum().clamp(min=1)
    if teacher_logits is None:
        return lm, lm.detach(), torch.zeros(())
    student = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)
    per_token = (teacher.exp() * (teacher - student)).sum(-1).reshape(-1)
    kl = (per_token * weights).sum() / weights.sum().clamp(min=1) * temperature**2
    return lm_weight * lm + kl_weight * kl, lm.detach(), kl.detach()


VARIANTS = {"whole tensors (before)": whole_tensor_losses, "one pass, chunked": logit_losses}


def resident_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(work) -> tuple[float, int]:
    """(seconds, peak resident bytes above the start) of ``work()``."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = resident_bytes("VmRSS")
    started = time.perf_counter()
    work()
    return time.perf_counter() - started, resident_bytes("VmHWM") - before


def loss_only(repeats: int) -> dict[str, list[tuple[float, int]]]:
    """Forward + backward of LM + 0.5 KL on (4, 512, 49152) logits, each variant in turn."""
    torch.manual_seed(0)
    logits, teacher = torch.randn(4, 512, 49152), torch.randn(4, 512, 49152)
    ids, mask = torch.randint(0, 49152, (4, 512)), torch.ones(4, 511, dtype=torch.bool)
    results = {name: [] for name in VARIANTS}

    def work(function):
        leaf = logits.clone().requires_grad_()
        function(leaf, teacher, ids, mask, 0.5, 0.5, 1.0)[0].backward()

    for _ in range(repeats + 1):  # the first round warms up
        for name, function in VARIANTS.items():
            results[name].append(measured(lambda: work(function)))
    return {name: values[1:] for name, values in results.items()}


def train_steps(steps: int, converted: str) -> dict[str, list[tuple[float, int]]]:
    """``RecoveryRun.train_step`` with the teacher, each variant in turn (patched where run.py calls it)."""
    tokenizer = load_tokenizer(converted)
    text = assets.healing_text_path().read_text(encoding="utf-8")[:400_000]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"]]
    packed = pack_token_lists(ids, 512, max_rows=4 * (steps + 1) * len(VARIANTS))
    batches = [packed.rows(slice(4 * i, 4 * i + 4)) for i in range(len(packed) // 4)]
    config = RecoverConfig(model=converted, data=[str(assets.healing_text_path())], out=str(REPO / ".cache/unused"),
                           teacher=str(assets.default_model_gguf()), full_layers=True, compute_dtype="float32",
                           distill_weight=0.5, batch_size=4, seq_len=512, max_steps=steps + 1, learning_rate=3e-4)
    recovery = run_module.RecoveryRun(config, show_progress=False)
    recovery.start_accelerator()
    teacher = load_teacher(config.teacher)
    recovery.setup_training(make_trainable(load_student(converted), None, layers=True), teacher)
    recovery.model.train()
    results = {name: [] for name in VARIANTS}
    for round_ in range(steps + 1):
        for index, (name, function) in enumerate(VARIANTS.items()):
            run_module.logit_losses = function
            batch = batches[round_ * len(VARIANTS) + index]
            results[name].append(measured(lambda: recovery.train_step(batch)))
    run_module.logit_losses = logit_losses
    return {name: values[1:] for name, values in results.items()}


def summary(results: dict[str, list[tuple[float, int]]]) -> dict[str, dict[str, float]]:
    """Median seconds and peak GiB per variant."""
    return {name: {"seconds": statistics.median(s for s, _ in values),
                   "peak_gib": statistics.median(m for _, m in values) / 2**30} for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed loss-only repeats per variant, after a warm-up")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per variant, after a warm-up (0: none)")
    parser.add_argument("--converted", default=str(assets.cache_dir() / "converted" / "smollm2-135m-kv0.125-calibrated"))
    args = parser.parse_args()
    parts = {"loss only, (4, 512, 49152)": summary(loss_only(args.repeats))}
    if args.steps:
        parts["train step, SmolLM2-135M 12.5%, teacher, full layers"] = summary(train_steps(args.steps, args.converted))
    print(json.dumps({"threads": torch.get_num_threads(), "repeats": args.repeats, "steps": args.steps,
                      "results": parts}, indent=2))
    before, after = VARIANTS
    print("\n| measured | variant | median s | peak GiB above start |\n|---|---|---:|---:|")
    for part, rows in parts.items():
        for name, row in rows.items():
            print(f"| {part} | {name} | {row['seconds']:.2f} | {row['peak_gib']:.2f} |")
        print(f"| {part} | before / one pass | ×{rows[before]['seconds'] / rows[after]['seconds']:.2f} "
              f"| ×{rows[before]['peak_gib'] / max(rows[after]['peak_gib'], 1e-9):.2f} |")


if __name__ == "__main__":
    main()
