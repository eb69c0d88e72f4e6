"""The time budget of a recovery run (``--max-time 80m``): the training loop stops before a step that would end past
it, and the run ends as any run does (the last evaluation, the model written). The budget counts the loop's wall
time (steps, evaluations, checkpoints) summed over resumptions (``wall_seconds`` in the trainer state); the final
evaluation and the export come after it. The setting's forms (a number with an
optional unit: seconds, minutes or hours) are read by config.duration_seconds."""

from __future__ import annotations

import logging
from time import monotonic

import torch

log = logging.getLogger(__name__)


class TimeBudget:
    """Checked after every optimizer step: ``spent()`` is True once the next step, as long as the last one, would end
    past the budget (None: no budget). Every process takes the same decision (the main process's clock counts)."""

    def __init__(self, seconds: float | None, state: dict):
        self.seconds, self.state = seconds, state
        self.stopped = False
        state.setdefault("wall_seconds", 0.0)  # a checkpoint written before budgets existed
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
            log.info("--max-time: stopping after step %d (%.0f s of %.0f s spent); writing the model",
                     self.state["step"], self.state["wall_seconds"], self.seconds)
        return self.stopped
