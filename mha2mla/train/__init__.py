"""Recovery fine-tuning of converted MLA models: ``recover(RecoverConfig(...))``.

config (settings), data (reading + packing), model (student/teacher, LoRA), losses, checkpoint (resumable
state), trainer (the loop), export (merge and write the native checkpoint)."""

from mha2mla.train.config import MLA_LORA_TARGETS, SOURCE_LORA_TARGETS, RecoverConfig
from mha2mla.train.trainer import recover

__all__ = ["MLA_LORA_TARGETS", "SOURCE_LORA_TARGETS", "RecoverConfig", "recover"]
