"""What trains in a recovery run: a peft LoRA adapter, every attention parameter, or every decoder-layer parameter
(``make_trainable``), the checkpoint's values put back into those parameters, and the parameter counts, of the
loaded student or, before anything loads, of the student built on torch's ``meta`` device (memory.meta_counts;
docs/recover.md, "Memory")."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from mha2mla import UserError
from mha2mla.train.config import TRAINABLE_NORMS, LoraSettings


class ParameterCounts(NamedTuple):
    """Parameters of a run: the student's trainable and total, and the teacher folder's (None: no teacher folder)."""

    trainable: int
    total: int
    teacher: int | None = None


def make_trainable(model: nn.Module, lora: LoraSettings | None, layers: bool = False) -> nn.Module:
    """Wrap ``model`` in a peft LoRA model as ``lora`` says (adapters on its targets; with ``train_norms`` the
    model's kv_a_layernorm trains in full), or with ``lora=None`` unfreeze every parameter under ``self_attn``
    and nothing else (full-attention training) or, with ``layers``, every parameter of the decoder layers
    (attention, MLP, norms) while the embeddings, final norm and lm_head stay frozen (full-layer training).
    Returns the model to train."""
    if lora is None:
        model.requires_grad_(False)
        scope = ".layers." if layers else ".self_attn."
        count = 0
        for name, param in model.named_parameters():
            if scope in name:
                param.requires_grad_(True)
                count += 1
        if count == 0:
            raise UserError(f"the model has no {'decoder-layer' if layers else 'self_attn'} parameters to train.")
        return model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [target for target in lora.targets if target not in present]
    if missing:
        raise UserError(f"LoRA target(s) {', '.join(missing)} are not modules of this model; check --lora-targets.")
    norms = [name for name in TRAINABLE_NORMS if name in present] if lora.train_norms else []
    adapter = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        modules_to_save=norms or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model, a FutureWarning
        # on every run that is neither ours nor the user's to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, adapter)


def check_trainable_shapes(folder: Path, saved: dict[str, torch.Tensor], model: nn.Module) -> None:
    """The checkpoint's trainable tensors have the names and shapes of ``model``'s trainable parameters."""
    params = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    for name, tensor in saved.items():
        if name in params and tuple(tensor.shape) != params[name]:
            raise UserError(f"checkpoint {folder}: trainable.safetensors holds {name} of shape {tuple(tensor.shape)}, "
                            f"but this run trains it as {params[name]}; resume with the model and settings of that run.")


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (a checkpoint's trainable tensors by name) into ``model``'s trainable parameters."""
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    if set(params) != set(state):
        extra, missing = sorted(set(state) - set(params))[:3], sorted(set(params) - set(state))[:3]
        raise UserError(f"the checkpoint's trainable weights do not match this run (extra {extra}, missing {missing}).")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of ``model``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
