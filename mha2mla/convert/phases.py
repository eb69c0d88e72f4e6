"""Where a conversion spends its time: wall and CPU seconds per phase, reported in conversion_report.json.

The pipeline opens a :class:`PhaseClock` for the conversion; the code of each phase runs inside ``phase(name)``.
Seconds are exclusive: a phase entered inside another (the latent's refinement inside the low-rank solve, the
source heads inside the reconstruction) stops the outer phase's clocks, so the phases add up to the conversion.
Outside an open clock ``phase`` costs nothing, so the steps stay callable on their own. On a GPU every phase
boundary waits for the device, so a phase is charged with the kernels it queued rather than the next phase.

The phases: ``statistics`` (the calibration measure), ``solves`` (the closed-form latent steps and the assembly),
``refinement`` (the Adam fits inside the latent steps), ``source heads`` (the source attention's head outputs on
the source stream), ``refit`` and ``reconstruction`` (the fit steps), ``advance`` (both streams pushed through the
layer), ``layer read`` (the source layer read for the stream), ``writing`` (tensors, metadata, card) and ``other``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_ACTIVE: ContextVar[PhaseClock | None] = ContextVar("mha2mla_phase_clock", default=None)

# the phase each kind of plan step is charged to (convert/steps/registry.py's kinds)
PHASE_OF_STEP = {"rope_mixing": "solves", "rope_compensation": "solves", "lowrank": "solves", "kv_norm": "solves",
                 "refit": "refit", "reconstruct": "reconstruction"}


class PhaseClock:
    """Exclusive wall and CPU seconds (the process's, every thread's) per phase name."""

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else None
        self.device = device if device is not None and device.type == "cuda" else None
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, wall at (re)start, CPU at (re)start]
        self._started: tuple[float, float] | None = None

    def _now(self) -> tuple[float, float]:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter(), time.process_time()

    def _charge(self, entry: list, now: tuple[float, float]) -> None:
        self.seconds[entry[0]] += now[0] - entry[1]
        self.cpu_seconds[entry[0]] += now[1] - entry[2]

    @contextmanager
    def running(self):
        """Make this the clock that ``phase`` charges, for the ``with`` block (the whole conversion)."""
        token = _ACTIVE.set(self)
        self._started = self._now()
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def enter(self, name: str):
        now = self._now()
        if self._stack:
            self._charge(self._stack[-1], now)
        self._stack.append([name, *now])
        try:
            yield
        finally:
            done = self._now()
            self._charge(self._stack.pop(), done)
            if self._stack:
                self._stack[-1][1:] = done

    def totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """(wall, CPU) seconds per phase since ``running`` began, the time in no phase as ``other``."""
        wall, cpu = (now - start for now, start in zip(self._now(), self._started or self._now()))
        seconds = {name: round(value, 2) for name, value in self.seconds.items()}
        cpu_seconds = {name: round(value, 2) for name, value in self.cpu_seconds.items()}
        seconds["other"] = round(max(0.0, wall - sum(self.seconds.values())), 2)
        cpu_seconds["other"] = round(max(0.0, cpu - sum(self.cpu_seconds.values())), 2)
        return seconds, cpu_seconds


@contextmanager
def phase(name: str):
    """Charge the ``with`` block to phase ``name`` of the running conversion's clock (nothing when none runs)."""
    clock = _ACTIVE.get()
    if clock is None:
        yield
        return
    with clock.enter(name):
        yield
