"""The compute-dtype half of benchmarks/decode.py: the latent-cache engine in float32 and bfloat16 on the same
decode steps, its speed ratio and how far the bf16 logits move (the command is in decode.py's docstring).

bf16 tolerance, as this benchmark states it: bf16 keeps 8 significant bits (a relative rounding of 2^-9 per
operation) and the weights, activations and cache carry it through every layer, so no logit is exact; what
generation depends on is the probability of the likely token and the greedy choice. A run is within tolerance
(``within_bf16_tolerance``) when, over every decoded position and row:

- max |Δ logprob| of float32's top-1 token <= 0.5 nats (that token's probability within a factor about 1.65);
- top-1 agreement >= 90 %;
- every disagreement is a near tie: float32's own top-1 and top-2 logits within 0.25, the spacing of bf16 numbers
  between 32 and 64: two logits of that size that close are a tie at the resolution of a bf16 logit.

max |Δ logit| (the whole vocabulary) and max |Δ logprob| over float32's top-10 tokens are reported, not judged.
"""

from __future__ import annotations

import time

import torch

TOP_K = 10
MAX_TOP1_LOGPROB_DIFF = 0.5  # nats, at float32's top-1 token
MIN_TOP1_AGREEMENT = 0.9
NEAR_TIE = 0.25  # logits: the spacing of bf16 numbers in [32, 64)


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
    result["within_bf16_tolerance"] = (
        result["max_abs_logprob_diff_top1"] <= MAX_TOP1_LOGPROB_DIFF and result["top1_agreement"] >= MIN_TOP1_AGREEMENT
        and disagreement_margin <= NEAR_TIE)
    return result


def dtype_comparisons(rows: list[dict], agreements: dict) -> list[dict]:
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
        })
    return out


def markdown(comparisons: list[dict]) -> str:
    lines = [
        "| context | batch | dtype | fp32 tok/s | tok/s | × fp32 | max abs Δ logit | max abs Δ logprob (top-1) | top-1 agree "
        "| within tolerance |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in comparisons:
        lines.append(
            f"| {c['context']} | {c['batch']} | {c['compute_dtype']} | {c['float32_tokens_per_s']:.2f} | "
            f"{c['tokens_per_s']:.2f} | {c['ratio_vs_float32']:.2f} | {c['max_abs_logit_diff']:.3f} | "
            f"{c['max_abs_logprob_diff_top1']:.3f} | {100 * c['top1_agreement']:.1f}% | "
            f"{'yes' if c['within_bf16_tolerance'] else 'no'} |"
        )
    return "\n".join(lines)
