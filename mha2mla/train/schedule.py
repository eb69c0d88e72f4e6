"""The learning-rate schedule of a recovery run."""

from __future__ import annotations

import math

from mha2mla.train.config import RecoverConfig


def lr_multiplier(config: RecoverConfig, total_steps: int):
    """Linear warmup over ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` (or constant)."""
    warmup = config.warmup_steps

    def multiplier(step: int) -> float:  # step = optimizer steps already taken
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape

    return multiplier
