"""Training losses on packed rows (segment starts are never targets): next-token loss, logit distillation and
intermediate-state (residual stream) distillation.
Held-out perplexity goes through mha2mla.evaluation.perplexity.batch_nll, the project's one perplexity sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits (B, L, V); input_ids (B, L); mask (B, L-1) bool."""
    shifted = logits[:, :-1].float()  # (B, L-1, V)
    targets = input_ids[:, 1:]  # (B, L-1)
    losses = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), reduction="none")
    weights = mask.reshape(-1).to(losses.dtype)
    return (losses * weights).sum() / weights.sum().clamp(min=1)


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(teacher || student) on temperature-softened next-token distributions, times T^2 (so its gradient
    scale does not shrink with T), averaged over the target positions. Logits (B, L, V); mask (B, L-1)."""
    student = F.log_softmax(student_logits[:, :-1].float() / temperature, dim=-1)  # (B, L-1, V)
    teacher = F.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)  # (B, L-1, V)
    per_token = (teacher.exp() * (teacher - student)).sum(-1)  # (B, L-1)
    weights = mask.to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp(min=1) * temperature**2



def hidden_state_loss(student_states, teacher_states) -> torch.Tensor:
    """Layer-wise distillation of the residual stream: for every layer's output (the embeddings excluded: they are
    the same weights), the mean squared difference between the student's and the teacher's hidden states divided by
    the mean square of the teacher's (so every layer weighs the same whatever its scale), averaged over layers.
    ``*_states``: tuples of (B, L, H) from ``output_hidden_states=True`` (docs/recover.md, "Objectives")."""
    if len(student_states) != len(teacher_states):
        raise ValueError(f"the student has {len(student_states) - 1} layers and the teacher {len(teacher_states) - 1}")
    losses = [(student.float() - teacher.float()).pow(2).mean() / teacher.float().pow(2).mean().clamp(min=1e-12)
              for student, teacher in zip(student_states[1:], teacher_states[1:])]
    return torch.stack(losses).mean()
