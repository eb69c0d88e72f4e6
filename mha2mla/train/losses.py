"""Training losses on packed rows (segment starts are never targets): next-token loss and logit distillation,
computed together in one pass over the logits (``logit_losses``), their formula and gradient in one place
(``chunk_losses``). A run computes them against the lm_head without whole logits (head_losses.py); ``logit_losses``
is the same on logits already made (a sharded model's, and the reference of the tests). Held-out perplexity goes
through mha2mla.evaluation.perplexity.batch_nll, the project's one perplexity sum."""

from __future__ import annotations

import torch

# Positions per chunk: each chunk's float32 temporaries are chunk x V (256 x 49,152 x 4 bytes = 50 MB for SmolLM2)
# instead of whole (B, L, V) copies (docs/recover.md, "Losses in one pass").
CHUNK_POSITIONS = 256


class _LogitLosses(torch.autograd.Function):
    """``lm_weight * LM + kl_weight * KL`` with the LM and KL parts, the gradient with respect to the logits
    computed in the forward pass chunk by chunk and kept as one tensor of the logits' shape and dtype."""

    @staticmethod
    def forward(ctx, logits, teacher_logits, input_ids, weights, lm_weight, kl_weight, temperature):
        grad = torch.zeros_like(logits) if ctx.needs_input_grad[0] else None
        parts = torch.zeros(2, device=logits.device)  # weighted LM and KL sums
        positions = logits.shape[1] - 1
        for row in range(logits.shape[0]):
            for start in range(0, positions, CHUNK_POSITIONS):
                end = min(start + CHUNK_POSITIONS, positions)
                teacher = None if teacher_logits is None else teacher_logits[row, start:end]
                chunk_grad = chunk_losses(logits[row, start:end], teacher, input_ids[row, start + 1:end + 1],
                                    weights[row, start:end], lm_weight, kl_weight, temperature, parts)
                if grad is not None:
                    grad[row, start:end] = chunk_grad
        ctx.save_for_backward(grad)
        return weighted_totals(ctx, parts, lm_weight, kl_weight)

    @staticmethod
    def backward(ctx, grad_total, _grad_lm, _grad_kl):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None


def weighted_totals(ctx, parts: torch.Tensor, lm_weight: float, kl_weight: float):
    """An autograd forward's outputs from its (LM, KL) sums: the weighted total, then the two parts (reported, not
    differentiated)."""
    lm, kl = parts[0].clone(), parts[1].clone()
    ctx.mark_non_differentiable(lm, kl)
    return lm_weight * lm + kl_weight * kl, lm, kl


def chunk_losses(logits, teacher, targets, weights, lm_weight, kl_weight, temperature, parts):
    """One chunk of positions (C, V): adds its weighted LM and KL sums to ``parts`` and returns the gradient of
    ``lm_weight * LM + kl_weight * KL`` with respect to its logits. LM: ``-log p[target]``, gradient
    ``p - onehot``; KL(q || p_T) times T^2 (p_T, q: student and teacher softmax at temperature T), gradient
    ``T (p_T - q)``; both times each position's weight.

    The student's softmax takes one pass of exp over the chunk: ``p = exp(x - max) / sum`` and
    ``log p[target] = x[target] - (max + log sum)``, where log_softmax followed by exp would take two (over C x V
    values, a large part of a CPU training step: docs/benchmarks.md, "Speed and memory")."""
    student = logits.float()
    top = student.amax(-1, keepdim=True)  # (C, 1)
    p = (student - top).exp_()  # (C, V)
    total = p.sum(-1, keepdim=True)
    p.div_(total)
    log_total = top + total.log()  # (C, 1): log sum exp
    nll = log_total.squeeze(1) - student.gather(1, targets[:, None]).squeeze(1)
    parts[0] += (nll * weights).sum()
    distill = teacher is not None and kl_weight != 0
    if distill:
        log_p_t = student - log_total if temperature == 1 else torch.log_softmax(student / temperature, dim=-1)
        log_q = torch.log_softmax(teacher.float() / temperature, dim=-1)
        q = log_q.exp()
        per_position = log_q.sub_(log_p_t).mul_(q).sum(-1)  # sum q (log q - log p_T)
        parts[1] += (per_position * weights).sum() * temperature**2
        scale = kl_weight * temperature
        if temperature == 1:  # p_T is p: lm_weight p + scale (p - q)
            grad = p.mul_(lm_weight + scale).sub_(q, alpha=scale)
        else:
            grad = p.mul_(lm_weight).add_(log_p_t.exp_().sub_(q), alpha=scale)
    else:
        grad = p.mul_(lm_weight)  # lm_weight * p
    grad.scatter_add_(1, targets[:, None], torch.full_like(nll, -lm_weight)[:, None])
    return grad.mul_(weights[:, None]).to(logits.dtype)


def logit_losses(logits: torch.Tensor, teacher_logits: torch.Tensor | None, input_ids: torch.Tensor,
                 mask: torch.Tensor, lm_weight: float = 1.0, kl_weight: float = 0.0, temperature: float = 1.0):
    """``(lm_weight * LM + kl_weight * KL, LM, KL)``: LM the mean next-token cross-entropy, KL the mean
    KL(teacher || student) of the temperature-softened next-token distributions times T^2 (so its gradient scale
    does not shrink with T), both over the target positions. Only the first is differentiable. logits and
    teacher_logits (B, L, V) (teacher None: KL 0); input_ids (B, L); mask (B, L-1) bool.

    One pass in chunks of positions, float32 inside whatever the logits' dtype, instead of several whole
    (B, L, V) float32 copies (softmaxes, differences, saved activations): the run keeps only the logits and their
    gradient (docs/recover.md, "Losses in one pass")."""
    weights = mask.to(torch.float32)
    weights = weights / weights.sum().clamp(min=1)
    return _LogitLosses.apply(logits, teacher_logits, input_ids, weights, float(lm_weight),
                              float(kl_weight), float(temperature))


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (``logit_losses`` with the LM term only)."""
    return logit_losses(logits, None, input_ids, mask)[0]

