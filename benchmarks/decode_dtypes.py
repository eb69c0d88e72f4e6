"""The compute-dtype half of benchmarks/decode.py: the latent-cache engine in float32 and bfloat16 on the same
decode steps, its speed ratio and how far the bf16 logits move (the command is in decode.py's docstring).

bf16 tolerance, as this benchmark states it. bf16 keeps 8 significant bits (a relative rounding of 2^-9 per
operation) and the weights, activations and cache carry it through every layer, so no logit is exact, and how far
logits move depends on the model; the accepted bar for "runs fine in bf16" is the model's own transformers
implementation in bf16. So for every context the converted checkpoint also runs through transformers'
DeepseekV3 in float32 and in bfloat16 on the same tokens (one forward over the prompt and the fed tokens), and
the engine's bf16 is within tolerance (``within_bf16_tolerance``) when, over every decoded position and row:

- its max |Δ logit| and its median |Δ logprob| of float32's top-1 token are of the same order as transformers'
  bf16's: at most 1.5 times them. Not "no larger": the engine rounds in other places (absorbed decode, a bf16
  cache read by its own attention) and a few dozen positions are a small sample (bf16 kernels also round
  differently for different row counts, so batch sizes differ). The median, because the largest of a few dozen
  positions swings more; the max is reported next to transformers';
- every top-1 disagreement is a near tie: float32's own top-1 and top-2 logits within 0.25, the spacing of bf16
  numbers between 32 and 64 (a tie at the resolution of a bf16 logit of that size). How often near ties occur
  depends on the text and the model, so top-1 agreement itself is reported, not judged.

max |Δ logprob| over float32's top-10 tokens is reported too.
"""

from __future__ import annotations

import time

import torch

TOP_K = 10
NEAR_TIE = 0.25  # logits: the spacing of bf16 numbers in [32, 64)
SAME_ORDER = 1.5  # the engine's deviation against transformers' bf16's


def time_engine_decode(engine, cache, first_token: torch.Tensor, warmup: int, steps: int,
                       forced: list[torch.Tensor] | None = None):
    """Greedy decode steps with the latent-cache model -> (per-step seconds of the timed steps, logits of every
    step (B, V) float32 on CPU, the tokens fed at every step). ``forced``: feed these tokens instead of the greedy
    ones (another dtype's), so that two dtypes score the same positions."""
    tokens, times, logits, fed = first_token, [], [], []
    for step in range(warmup + steps):
        if forced is not None:
            tokens = forced[step]
        fed.append(tokens)
        start = time.perf_counter()
        out = engine.decode(cache, tokens)
        tokens = out.argmax(-1)
        elapsed = time.perf_counter() - start
        logits.append(out.float().cpu())
        if step >= warmup:
            times.append(elapsed)
    return times, logits, fed


def logits_agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """How far ``other``'s logits are from ``reference``'s (float32's) over the same positions (lists of (B, V),
    the prefill's last position first)."""
    ref, got = torch.cat(reference).float(), torch.cat(other).float()  # (positions * B, V)
    ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
    top = ref.topk(TOP_K, dim=-1).indices  # (N, k), float32's top-1 first
    logprob_diff = (got_lp.gather(-1, top) - ref_lp.gather(-1, top)).abs()  # (N, k)
    ref_top2 = ref.topk(2, dim=-1).values
    margins = ref_top2[:, 0] - ref_top2[:, 1]  # float32's own top-1 lead
    agree = got.argmax(-1) == ref.argmax(-1)
    disagreement_margin = float(margins[~agree].max()) if (~agree).any() else 0.0
    result = {
        "positions": ref.shape[0],
        "max_abs_logit_diff": round(float((got - ref).abs().max()), 4),
        "max_abs_logprob_diff_top1": round(float(logprob_diff[:, 0].max()), 4),
        "median_abs_logprob_diff_top1": round(float(logprob_diff[:, 0].median()), 4),
        "max_abs_logprob_diff_top10": round(float(logprob_diff.max()), 4),
        "top1_agreement": round(float(agree.float().mean()), 4),
        "top1_disagreement_max_f32_margin": round(disagreement_margin, 4),
    }
    return result


def transformers_agreement(converted, prompt: list[int], fed: list[int]) -> dict:
    """transformers' DeepseekV3 of the converted checkpoint in bfloat16 against float32 over the positions the
    engine decoded: one forward over ``prompt + fed``, logits from the prompt's last token on."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([prompt + fed])
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype).eval()
        with torch.inference_mode():
            logits[dtype] = model(ids).logits[0, len(prompt) - 1 :].float()  # (len(fed) + 1, V)
        del model
    return logits_agreement([logits[torch.float32]], [logits[torch.bfloat16]])


def judge(engine: dict, transformers: dict | None) -> bool | None:
    """The engine's bf16 against the tolerance above (None without transformers' reference)."""
    if transformers is None:
        return None
    return (engine["max_abs_logit_diff"] <= SAME_ORDER * transformers["max_abs_logit_diff"]
            and engine["median_abs_logprob_diff_top1"] <= SAME_ORDER * transformers["median_abs_logprob_diff_top1"]
            and engine["top1_disagreement_max_f32_margin"] <= NEAR_TIE)


def dtype_comparisons(rows: list[dict], agreements: dict, references: dict) -> list[dict]:
    """One row per (context, batch, reduced dtype): its decode tokens/s against float32's, and its logits."""
    engines = {(r["context"], r["batch"], r["compute_dtype"]): r for r in rows if r.get("compute_dtype")}
    out = []
    for (context, batch, dtype), row in engines.items():
        base = engines.get((context, batch, "float32"))
        if dtype == "float32" or base is None:
            continue
        out.append({
            "context": context, "batch": batch, "compute_dtype": dtype,
            "float32_tokens_per_s": base["decode_tokens_per_s"], "tokens_per_s": row["decode_tokens_per_s"],
            "ratio_vs_float32": round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3),
            "prefill_ratio_vs_float32": round(base["prefill_s"] / row["prefill_s"], 3) if row["prefill_s"] else None,
            **agreements[(context, batch, dtype)],
            "transformers_bf16": references.get(context),
            "within_bf16_tolerance": judge(agreements[(context, batch, dtype)], references.get(context)),
        })
    return out


def markdown(comparisons: list[dict]) -> str:
    """The engine's bf16 rows, each context's transformers bf16 reference row (batch 1, no speed) after them."""
    lines = [
        "| context | batch | run | fp32 tok/s | tok/s | × fp32 | max abs Δ logit | abs Δ logprob top-1: median / max "
        "| top-1 agree | within tolerance |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    shown = set()
    for c in comparisons:
        verdict = {True: "yes", False: "no", None: ""}[c["within_bf16_tolerance"]]
        lines.append(
            f"| {c['context']} | {c['batch']} | mla-engine {c['compute_dtype']} | {c['float32_tokens_per_s']:.2f} | "
            f"{c['tokens_per_s']:.2f} | {c['ratio_vs_float32']:.2f} | {c['max_abs_logit_diff']:.3f} | "
            f"{c['median_abs_logprob_diff_top1']:.3f} / {c['max_abs_logprob_diff_top1']:.3f} | "
            f"{100 * c['top1_agreement']:.1f}% | {verdict} |"
        )
        reference = c["transformers_bf16"]
        if reference is not None and c["context"] not in shown:
            shown.add(c["context"])
            lines.append(
                f"| {c['context']} | 1 | transformers bfloat16 (the bar) |  |  |  | {reference['max_abs_logit_diff']:.3f} | "
                f"{reference['median_abs_logprob_diff_top1']:.3f} / {reference['max_abs_logprob_diff_top1']:.3f} | "
                f"{100 * reference['top1_agreement']:.1f}% |  |"
            )
    return "\n".join(lines)
