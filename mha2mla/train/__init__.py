"""Recovery fine-tuning of converted MLA models: ``recover(RecoverConfig(...))``.

config (settings, LoRA settings), data (tokenizing + packing), model (student/teacher, LoRA), losses,
checkpoint (resumable state), recipe (``RecoveryRun``: setup, train step, evaluation, checkpoints),
trainer (``recover``, which runs the recipe), export (merge and write the native checkpoint).

``recover`` and ``RecoveryRun`` load on first use, so reading the settings (``mha2mla recover --help``)
does not import torch, accelerate and peft."""

from __future__ import annotations

import importlib

from mha2mla import UserError
from mha2mla.train.config import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS, LoraSettings, RecoverConfig

_LAZY = {"recover": "mha2mla.train.trainer", "RecoveryRun": "mha2mla.train.run"}

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
