"""How benchmarks/heal.py scores a model (no suite of its own: ``score`` and ``curve`` there use it): perplexity on
the in-domain slices (the KJV and the Python docs, whose first 30% the in-domain healing text reads) and the unseen
ones (the fortunes and the Debian Policy Manual, which no healing text reads), accuracy on the continuation tasks
fortunes_mc and debian_policy_mc (scored as lm-eval scores them), each as a multiple of (or points off) the
source's, and the Markdown table of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness
from harness import HELD_OUT_SLICES as SLICES

IN_DOMAIN_SLICES = SLICES  # the texts whose first 30% the in-domain healing text reads
UNSEEN_SLICES = ("fortunes", "debian_policy")  # texts no healing text reads (mha2mla.io.cache.UNSEEN_TEXTS)
DOMAINS = (*IN_DOMAIN_SLICES, *UNSEEN_SLICES)
DOMAIN_LABEL = {**dict.fromkeys(IN_DOMAIN_SLICES, "in-domain"), **dict.fromkeys(UNSEEN_SLICES, "unseen")}
MC_TEXTS = UNSEEN_SLICES  # the continuation tasks fortunes_mc, debian_policy_mc
MC_TASKS = tuple(f"{name}_mc" for name in MC_TEXTS)


def continuation_accuracy(model, tokenizer, text: str, limit: int | None = None) -> dict:
    """``acc`` and ``acc_norm`` on the four-way continuation items of ``text`` (the first ``limit``), the items of the
    fortunes_mc / debian_policy_mc tasks (``continuation_items``), scored as lm-eval scores them: the log-likelihood
    of " " + choice after the context (the context's tokens, then the rest of the whole text's), acc_norm per byte.
    An item's four choices go through one forward, right-padded (a causal model's earlier positions ignore the pad)."""
    import torch

    from mha2mla.evaluation.continuation_items import continuation_items

    right = right_norm = 0
    items = continuation_items(text)[:limit]
    for item in items:
        start = len(tokenizer(item["context"], add_special_tokens=False)["input_ids"])
        wholes = [tokenizer(item["context"] + " " + c, add_special_tokens=False)["input_ids"] for c in item["choices"]]
        width = max(len(whole) for whole in wholes)
        ids = torch.tensor([whole + [whole[-1]] * (width - len(whole)) for whole in wholes])  # (4, L)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)  # (4, L-1, V)
        picked = logprobs.gather(2, ids[:, 1:, None])[..., 0]  # (4, L-1): each next token's log-probability
        totals = [picked[i, start - 1:len(whole) - 1].sum().item() for i, whole in enumerate(wholes)]
        per_byte = [total / len((" " + c).encode("utf-8")) for total, c in zip(totals, item["choices"])]
        right += max(range(4), key=totals.__getitem__) == item["answer"]
        right_norm += max(range(4), key=per_byte.__getitem__) == item["answer"]
    return {"acc": right / len(items), "acc_norm": right_norm / len(items), "items": len(items)}


def model_scores(folder: Path | str, num_tokens: int, state: dict | None = None, items: int | None = None) -> dict:
    """Perplexity on every slice (DOMAINS) and accuracy on the first ``items`` items (None: all, 0: no task) of both
    continuation tasks of the model in ``folder`` (float32), ``state`` (a checkpoint's trainable weights) loaded
    over it when given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.evaluation.perplexity import held_out_perplexity
    from mha2mla.io.cache import cached_held_out_text

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if state is not None:
        missing = set(state) - set(model.state_dict())
        assert not missing, f"checkpoint weights the model lacks: {sorted(missing)[:3]}"
        model.load_state_dict(state, strict=False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    scores = {name: held_out_perplexity(model, tokenizer, cached_held_out_text(name), num_tokens=num_tokens)
              for name in DOMAINS}
    for name in MC_TEXTS if items != 0 else ():
        text = cached_held_out_text(name).read_text(encoding="utf-8")
        scores[f"{name}_mc"] = continuation_accuracy(model, tokenizer, text, items)
    return scores


def ratios(scores: dict, source: dict) -> dict:
    """Each slice's perplexity as a multiple of the source's, each task's accuracy minus the source's (points)."""
    return {**{name: round(scores[name] / source[name], 3) for name in DOMAINS},
            **{f"{t}_points": round(100 * (scores[t]["acc"] - source[t]["acc"]), 1) for t in MC_TASKS if t in scores}}


def source_scores(work: Path, num_tokens: int, items: int | None = None) -> dict:
    """The source's scores (the dequantized GGUF), computed once per slice length and item count into WORK."""
    path = work / f"source_scores_{num_tokens}_{items}.json"
    if not path.is_file():
        scores = model_scores(harness.source_model(), num_tokens, items=items)
        work.mkdir(parents=True, exist_ok=True)  # `score` may come before `prepare`
        path.write_text(json.dumps(scores))
    return json.loads(path.read_text())


def score_table(rows: list[dict], source: dict, first: str) -> str:
    """The Markdown table: perplexity (× source) on the in-domain then the unseen slices, then MC accuracy."""
    tasks = [t for t in MC_TASKS if t in source and any(t in row["scores"] for row in rows)]
    head = [f"{DOMAIN_LABEL[n]}: {n} ppl (×)" for n in DOMAINS] + [f"unseen: {t} acc (points)" for t in tasks]
    cells = [f"{source[n]:.2f}" for n in DOMAINS] + [f"{source[t]['acc']:.2f}" for t in tasks]
    lines = [f"| {first} | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head), "| source | " + " | ".join(cells)
             + " |"]
    for row in rows:
        s, r = row["scores"], row["x_source"]
        cells = [f"{s[n]:.2f} (×{r[n]:.3f})" for n in DOMAINS]
        cells += [f"{s[t]['acc']:.2f} ({r[t + '_points']:+.1f})" if t in s else "" for t in tasks]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """No suite: ``--help`` says what the module holds, anything else where to measure."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    parser.error("no suite of its own: run python benchmarks/heal.py score (or curve)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
