"""Token perplexity: ``batch_nll`` is the one primitive every perplexity in the project goes through.

``window_perplexity`` cuts token ids into non-overlapping windows, each scored independently (every window's
first token is context only). ``held_out_perplexity`` scores the project's fixed evaluation slice of a text
(``num_tokens`` tokens from a third of the way in, see ``mha2mla.data.held_out``); ``text_perplexity`` scores
the start of any text file (``mha2mla eval --text``, docs/eval.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.data.held_out import held_out_token_ids, text_token_ids


@torch.no_grad()
def batch_nll(model, batch: dict[str, torch.Tensor], target_mask: torch.Tensor | None = None) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of one batch and the number of targets it covers.

    ``batch`` holds at least ``input_ids`` (B, L) and is passed to the model as keyword arguments;
    the logits at position t score token t + 1 (float32 cross-entropy). ``target_mask`` (B, L - 1, bool)
    selects which of those targets count; None counts them all. This is the project's one perplexity
    primitive: ``exp(sum of nll / sum of counts)`` over batches is the perplexity.
    """
    input_ids = batch["input_ids"]
    logits = model(**batch, use_cache=False).logits[:, :-1].float()  # (B, L-1, V)
    targets = input_ids[:, 1:]  # (B, L-1)
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(targets.shape)  # (B, L-1)
    if target_mask is None:
        return float(nll.sum()), targets.numel()
    mask = target_mask.to(device=nll.device, dtype=torch.bool)
    return float(nll[mask].sum()), int(mask.sum())


@torch.no_grad()
def window_perplexity(model, token_ids: list[int], window: int = 512, batch_size: int = 4) -> float:
    ids = torch.tensor(token_ids[: len(token_ids) // window * window]).view(-1, window)  # (N, window)
    device = next(model.parameters()).device
    total_nll, total_count = 0.0, 0
    for start in range(0, ids.shape[0], batch_size):
        nll, count = batch_nll(model, {"input_ids": ids[start : start + batch_size].to(device)})
        total_nll += nll
        total_count += count
    return math.exp(total_nll / total_count)


def held_out_perplexity(model, tokenizer, path: str | Path, num_tokens: int = 16384, window: int = 512) -> float:
    """Perplexity of ``model`` on the held-out slice of the text in ``path`` (e.g. the cached KJV)."""
    return window_perplexity(model, held_out_token_ids(tokenizer, path, num_tokens), window)


def text_perplexity(
    model, tokenizer, path: str | Path, max_tokens: int = 16384, window: int = 512, batch_size: int = 4
) -> dict:
    """Token perplexity of ``model`` on the first ``max_tokens`` tokens of the text file ``path``.

    Windows are capped by the model's context length; a text shorter than one window is scored as one window,
    and tokens after the last whole window are left out. Returns ``{"token_perplexity", "tokens"}`` (the number
    of tokens in the scored windows).
    """
    ids = text_token_ids(tokenizer, path, max_tokens)
    if len(ids) < 2:
        raise UserError(f"{path} holds fewer than 2 tokens of text; pass a longer text file.")
    context = getattr(model.config, "max_position_embeddings", None) or window
    window = min(window, context, len(ids))
    perplexity = window_perplexity(model, ids, window, batch_size)
    return {"token_perplexity": perplexity, "tokens": len(ids) // window * window}
