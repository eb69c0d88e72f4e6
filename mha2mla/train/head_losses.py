"""The LM and distillation losses computed against the lm_head chunk by chunk of positions, so that no full
(B, L, V) logits tensor -- the student's, its gradient or the teacher's -- ever exists (docs/recover.md, "Losses
against the lm_head").

``head_losses(hidden, weight, teacher_hidden, teacher_weight, ...)`` takes the final hidden states (B, L, H) and the
lm_head weights (V, H) and returns what ``logit_losses(hidden @ weight.T, ...)`` returns, values and gradients: each
chunk's logits are ``F.linear`` of its hidden states (under the caller's autocast, as the lm_head module computes
them), its loss terms and the gradient with respect to its logits come from losses.py's ``chunk_losses`` (the one
formula), and that gradient is turned at once into the gradient of the chunk's hidden states (``g @ W``) and of the
weight (``g.T @ h``, when it trains). The forward pass keeps only those two gradients (B, L, H) and (V, H), never
anything of width V beyond one chunk.

``final_hidden`` runs a transformers causal LM so that it projects nothing (``logits_to_keep`` an empty index) and
gives its decoder's last hidden states instead, read by a forward hook on ``get_decoder()``: the model's own forward
runs (DDP's gradient hooks included), only the lm_head is left to ``head_losses``."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mha2mla.train.losses import CHUNK_POSITIONS, chunk_losses, logit_losses, weighted_totals

NO_POSITIONS = torch.zeros(0, dtype=torch.long)  # ``logits_to_keep``: project no position


class _HeadLosses(torch.autograd.Function):
    """``lm_weight * LM + kl_weight * KL`` and its two parts from the hidden states and the lm_head weight, the
    gradients with respect to both computed in the forward pass one chunk of positions at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, weights, lm_weight, kl_weight,
                temperature, chunk):
        # hidden (N, H), weight (V, H), teacher_hidden (N, Ht) or None, targets and weights (N,): N positions
        ctx.weight_dtype = weight.dtype
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        parts = torch.zeros(2, device=hidden.device)  # weighted LM and KL sums
        device = hidden.device.type
        if torch.is_autocast_enabled(device):  # cast once, not per chunk: autocast would cast it to this dtype anyway
            weight = weight.to(torch.get_autocast_dtype(device))
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = F.linear(hidden[start:end], weight)  # (C, V), in the autocast dtype as lm_head computes it
            teacher = None if teacher_hidden is None else F.linear(teacher_hidden[start:end], teacher_weight)
            grad = chunk_losses(logits, teacher, targets[start:end], weights[start:end], lm_weight, kl_weight,
                                temperature, parts)  # (C, V), in the logits' dtype
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad @ weight.to(grad.dtype)).to(hidden.dtype)  # (C, H)
            if grad_weight is not None:
                grad_weight.addmm_(grad.float().T, hidden[start:end].float())  # (V, H)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return weighted_totals(ctx, parts, lm_weight, kl_weight)

    @staticmethod
    def backward(ctx, grad_total, _grad_lm, _grad_kl):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def head_losses(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor | None,
                teacher_weight: torch.Tensor | None, input_ids: torch.Tensor, mask: torch.Tensor,
                lm_weight: float = 1.0, kl_weight: float = 0.0, temperature: float = 1.0,
                chunk: int | None = None):
    """``(lm_weight * LM + kl_weight * KL, LM, KL)`` as ``logit_losses`` defines them, from the final hidden states
    ``hidden`` (B, L, H) and the lm_head ``weight`` (V, H) (the teacher's: ``teacher_hidden`` (B, L, Ht) and
    ``teacher_weight`` (V, Ht), or None), ``input_ids`` (B, L), ``mask`` (B, L-1) bool. Only the first is
    differentiable, with respect to ``hidden`` and (when it requires grad) ``weight``. ``chunk``: positions per
    chunk (default ``CHUNK_POSITIONS``)."""
    size = hidden.shape[-1]
    flat = hidden[:, :-1].reshape(-1, size)  # (N, H), N = B (L-1): the positions that have a next token
    teacher = None if teacher_hidden is None else teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1])
    weights = mask.to(torch.float32).reshape(-1)
    weights = weights / weights.sum().clamp(min=1)
    targets = input_ids[:, 1:].reshape(-1)
    return _HeadLosses.apply(flat, weight, teacher, teacher_weight, targets, weights, float(lm_weight),
                             float(kl_weight), float(temperature), int(chunk or CHUNK_POSITIONS))


@contextlib.contextmanager
def _capture_last_hidden(model):
    """Record the last hidden states of ``model``'s decoder (``get_decoder()``) while the block runs."""
    captured = {}

    def hook(_module, _args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def final_hidden(model, unwrapped, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The final hidden states (B, L, H) of a causal LM for ``batch``, through ``model``'s own forward (a DDP
    wrapper's included) with no position projected on the vocabulary. ``unwrapped``: the transformers model
    inside ``model`` (peft's wrapper is fine), whose decoder is hooked."""
    with _capture_last_hidden(unwrapped) as captured:
        model(**batch, use_cache=False, logits_to_keep=NO_POSITIONS.to(batch["input_ids"].device))
    return captured["hidden"]


def micro_batch_losses(model, unwrapped, teacher, batch: dict[str, torch.Tensor], mask: torch.Tensor,
                       distill_weight: float, temperature: float, whole_logits: bool = False):
    """``(loss, LM, KL)`` of one micro-batch: ``(1 - w) LM + w KL`` (w ``distill_weight``; no ``teacher``: LM only),
    against the lm_heads chunk by chunk; ``whole_logits``: from the models' whole logits instead (``logit_losses``,
    the same values: a sharded model's lm_head weight is only whole inside its forward)."""
    weight = distill_weight if teacher is not None else 0.0
    if not whole_logits:
        hidden = final_hidden(model, unwrapped, batch)  # (B, L, H)
        teacher_hidden = teacher_head = None
        if teacher is not None:
            with torch.no_grad():
                teacher_hidden = final_hidden(teacher, teacher, batch)
            teacher_head = teacher.get_output_embeddings().weight
        head = unwrapped.get_output_embeddings().weight
        return head_losses(hidden, head, teacher_hidden, teacher_head, batch["input_ids"], mask, 1 - weight, weight,
                           temperature)
    logits = model(**batch, use_cache=False).logits  # (B, L, V)
    with torch.no_grad():
        teacher_logits = None if teacher is None else teacher(**batch, use_cache=False).logits
    return logit_losses(logits, teacher_logits, batch["input_ids"], mask, 1 - weight, weight, temperature)
