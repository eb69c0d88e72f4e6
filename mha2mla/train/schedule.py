"""The schedule of a recovery run: the learning rate warms up and decays (``lr_multiplier``); the time budget
(``--max-time 80m``, ``TimeBudget``) stops the loop before a step that would end past it, and the run ends as any run
does (the last evaluation, the model written). The budget counts the loop's wall time (steps, evaluations,
checkpoints) summed over resumptions (``wall_seconds`` in the trainer state); the final evaluation and the export
come after it. The setting's forms are read by config.duration_seconds."""

from __future__ import annotations

import logging
import math
from time import monotonic

import torch

from mha2mla.train.config import RecoverConfig

log = logging.getLogger(__name__)


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


class TimeBudget:
    """Checked before every optimizer step: ``spent()`` is True once the next step, as long as the last one, would end
    past the budget (None: no budget). Every process takes the same decision (the main process's clock counts)."""

    def __init__(self, seconds: float | None, state: dict):
        self.seconds, self.state = seconds, state
        self.stopped = False
        self._origin = monotonic() - state["wall_seconds"]
        self._last = monotonic()

    def spent(self, accelerator) -> bool:
        now = monotonic()
        self.state["wall_seconds"] = now - self._origin
        step_seconds, self._last = now - self._last, now
        if self.seconds is None:
            return False
        over = torch.tensor(float(self.state["wall_seconds"] + step_seconds > self.seconds), device=accelerator.device)
        if accelerator.num_processes > 1:
            over = accelerator.reduce(over, "max")
        self.stopped = bool(over.item())
        if self.stopped and accelerator.is_main_process:
            log.info("%s", stop_sentence(self.state["step"], self.state["wall_seconds"], self.seconds, step_seconds))
        return self.stopped


def stop_sentence(step: int, spent: float, budget: float, step_seconds: float) -> str:
    """Why the time budget ends the loop, in a sentence that reads right whether the time spent is under the budget
    (the next step would pass it) or already over it (a budget shorter than the first evaluation or step)."""
    where = "before the first step" if step == 0 else f"after step {step}"
    if spent >= budget:
        why = f"{seconds_text(spent)} spent, past the {seconds_text(budget)} budget"
    else:
        why = (f"{seconds_text(spent)} of the {seconds_text(budget)} budget spent, and one more step (about "
               f"{seconds_text(step_seconds)}) would end past it")
    return f"--max-time: stopping {where}: {why}; writing the model"


def seconds_text(seconds: float) -> str:
    """A duration for a log line: whole seconds for long ones, three significant digits for short ones, so that a
    budget under a second does not read as none."""
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.3g} s"
