"""Recovery fine-tuning of converted MLA models: ``recover(RecoverConfig(...))``.

trainer (``recover``: the run read top to bottom), config (settings, LoRA settings), devices (device, compute dtype,
accelerate, decided once), preflight (every check before anything loads; the memory estimate in memory), data/ (the
training and held-out rows from --data, the healing text or the teacher's text: rows.prepare_rows), model/ (student,
teacher, what trains, the merged model), loop (``RecoveryRun``: optimizer, the train step with losses / head_losses,
the loop with its schedule, evaluate, export), state/ (the run folder: settings and log, checkpoints in one format
version, where a run resumes).

``recover`` and ``RecoveryRun`` load on first use, so reading the settings (``mha2mla recover --help``)
does not import torch, accelerate and peft."""

from __future__ import annotations

import importlib

from mha2mla import UserError
from mha2mla.train.config import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS, LoraSettings, RecoverConfig

_LAZY = {"recover": "mha2mla.train.trainer", "RecoveryRun": "mha2mla.train.loop"}

__all__ = ["MLA_LORA_TARGETS", "SOURCE_LORA_TARGETS", "LoraSettings", "RecoverConfig", "RecoveryRun", "RunInterrupted",
           "recover"]


class RunInterrupted(UserError):
    """A recovery run stopped by Ctrl-C (its ``__cause__``: the KeyboardInterrupt): the sentence says what OUT
    keeps and how to continue. ``exit_code``: the status of an interrupted command (128 + SIGINT)."""

    exit_code = 130


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
