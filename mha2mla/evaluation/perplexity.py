"""Held-out perplexity on the project's fixed evaluation slices (see ``data/assets.py``):
``num_tokens`` tokens starting a third of the way into a text, cut into non-overlapping windows,
each scored independently (every window's first token is context only)."""

from __future__ import annotations

import math

import torch

from mha2mla.data.assets import held_out_token_ids


@torch.no_grad()
def window_perplexity(model, token_ids: list[int], window: int = 512, batch_size: int = 4) -> float:
    ids = torch.tensor(token_ids[: len(token_ids) // window * window]).view(-1, window)  # (N, window)
    device = next(model.parameters()).device
    total_nll, total_count = 0.0, 0
    for start in range(0, ids.shape[0], batch_size):
        batch = ids[start : start + batch_size].to(device)
        logits = model(batch, use_cache=False).logits.float()  # (b, window, V)
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        total_count += batch[:, 1:].numel()
    return math.exp(total_nll / total_count)


def held_out_perplexity(model, tokenizer, name: str, num_tokens: int = 16384, window: int = 512) -> float:
    """Perplexity of ``model`` on the held-out slice ``name`` (``kjv`` or ``python_docs``)."""
    return window_perplexity(model, held_out_token_ids(tokenizer, name, num_tokens), window)
