"""Recovery fine-tuning of converted MLA models: ``recover(RecoverConfig(...))``.

trainer (``recover``: the run read top to bottom), config (settings, LoRA settings), devices (device, compute dtype,
accelerate, decided once), preflight (every check before anything loads: model folder, OUT, resume point in resume,
memory estimate in memory), teacher (tokenizer and teacher), data / stream / generated (the training and held-out
rows), model (the student and its attention kernel), trainable (what trains, parameter counts), run
(``RecoveryRun``: optimizer and schedule, the train step with losses / head_losses, the loop with evaluate, log and
checkpoint, export through merge), distributed (what a checkpoint needs from every process).

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
