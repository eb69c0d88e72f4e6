"""Held-out perplexity of the model being trained, on packed rows, across processes."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from mha2mla.evaluation.perplexity import batch_nll
from mha2mla.train.data import PackedSequences, target_mask


@torch.no_grad()
def packed_perplexity(model, rows: PackedSequences, batch_size: int, accelerator: Accelerator,
                      sharded: bool = False) -> float:
    """Perplexity of ``model`` over packed ``rows`` (segment starts are not targets), scored with the project's
    ``batch_nll``: each process takes every P-th row and the sums are reduced across processes. Under FSDP
    (``sharded``) a forward gathers weights from every process, so all run the same number of batches: one whose
    rows have run out scores row 0 again and leaves it out of the sums."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    indices = torch.arange(accelerator.process_index, len(rows), accelerator.num_processes)
    busiest = -(-len(rows) // accelerator.num_processes) if sharded else len(indices)
    for start in range(0, busiest, batch_size):
        chosen = indices[start : start + batch_size]
        batch = {k: v.to(accelerator.device) for k, v in rows.rows(chosen if len(chosen) else indices.new_zeros(1)).items()}
        with accelerator.autocast():
            nll, count = batch_nll(model, batch, target_mask(batch["position_ids"]))
        if len(chosen):
            total += torch.tensor([nll, count], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, "sum")
    model.train(was_training)
    return math.exp(total[0].item() / max(1.0, total[1].item()))
