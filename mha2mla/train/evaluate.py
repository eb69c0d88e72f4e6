"""Held-out perplexity of the model being trained, on packed rows, across processes. Scored against the lm_head
chunk by chunk of positions as training's losses are (head_losses.py), so an evaluation holds no (B, L, V) logits
either; under FSDP from the whole logits (the sharded lm_head weight is whole only inside the model's forward)."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from mha2mla.evaluation.perplexity import batch_nll
from mha2mla.train.data.packing import PackedSequences, target_mask
from mha2mla.train.head_losses import final_hidden, head_losses


def _batch_nll(model, unwrapped, batch: dict[str, torch.Tensor], mask: torch.Tensor,
               whole_logits: bool) -> tuple[float, int]:
    """Summed next-token NLL of ``batch`` over the targets ``mask`` (B, L-1) selects, and their count: from the
    final hidden states against the lm_head in chunks (``unwrapped``: the transformers model inside ``model``), or
    (``whole_logits``) the project's ``batch_nll``."""
    if whole_logits:
        return batch_nll(model, batch, mask)
    hidden = final_hidden(model, unwrapped, batch)  # (B, L, H)
    _, mean, _ = head_losses(hidden, unwrapped.get_output_embeddings().weight, None, None, batch["input_ids"], mask)
    count = int(mask.sum())
    return float(mean) * count, count


@torch.no_grad()
def packed_perplexity(model, rows: PackedSequences, batch_size: int, accelerator: Accelerator,
                      sharded: bool = False) -> float:
    """Perplexity of ``model`` over packed ``rows`` (segment starts are not targets), scored as the project's
    ``batch_nll`` scores (in lm_head chunks; under FSDP ``batch_nll`` itself): each process takes every P-th row and
    the sums are reduced across processes. Under FSDP (``sharded``) a forward gathers weights from every process, so
    all run the same number of batches: one whose rows have run out scores row 0 again and leaves it out of the
    sums."""
    was_training, unwrapped = model.training, accelerator.unwrap_model(model)
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    indices = torch.arange(accelerator.process_index, len(rows), accelerator.num_processes)
    busiest = -(-len(rows) // accelerator.num_processes) if sharded else len(indices)
    for start in range(0, busiest, batch_size):
        chosen = indices[start : start + batch_size]
        batch = {k: v.to(accelerator.device) for k, v in rows.rows(chosen if len(chosen) else indices.new_zeros(1)).items()}
        with accelerator.autocast():
            nll, count = _batch_nll(model, unwrapped, batch, target_mask(batch["position_ids"]), sharded)
        if len(chosen):
            total += torch.tensor([nll, count], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, "sum")
    model.train(was_training)
    return math.exp(total[0].item() / max(1.0, total[1].item()))
