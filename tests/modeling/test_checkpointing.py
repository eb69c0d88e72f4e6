"""Selective and full activation checkpointing (mha2mla/modeling/checkpointing.py): the losses and gradients of
no checkpointing, in float32 and under bf16 autocast, through full-layer and LoRA (with dropout) training. What each
keeps is measured against the memory estimate by tests/train/test_recover_memory.py."""

from __future__ import annotations

import pytest
import torch

from mha2mla.modeling.checkpointing import enable_checkpointing
from mha2mla.train import LoraSettings
from mha2mla.train.data import pack_token_lists, target_mask
from mha2mla.train.head_losses import micro_batch_losses
from mha2mla.train.model import load_student
from mha2mla.train.model.trainable import make_trainable


def _batch():
    torch.manual_seed(1)
    documents = [torch.randint(1, 256, (n,)).tolist() for n in (30, 50, 17, 41)]
    return pack_token_lists(documents, seq_len=32).rows(slice(0, 4))


def _losses_and_grads(folder, mode: str, lora: LoraSettings | None, autocast: bool):
    torch.manual_seed(0)
    student = load_student(folder)
    enable_checkpointing(student, mode)
    student = make_trainable(student, lora, layers=lora is None)
    student.train()
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = micro_batch_losses(student, student, None, batch, target_mask(batch["position_ids"]), 0.0, 1.0)[0]
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in student.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
@pytest.mark.parametrize("lora", [None, LoraSettings(rank=4, dropout=0.1)], ids=["full layers", "lora with dropout"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_gives_the_losses_and_gradients_of_none(tiny_mla, mode, lora, autocast):
    loss, grads = _losses_and_grads(tiny_mla, "none", lora, autocast)
    loss_checkpointed, grads_checkpointed = _losses_and_grads(tiny_mla, mode, lora, autocast)
    torch.testing.assert_close(loss_checkpointed, loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == grads_checkpointed.keys() and len(grads) > 4
    for name, grad in grads.items():
        torch.testing.assert_close(grads_checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_an_unknown_mode_is_refused(tiny_mla):
    with pytest.raises(ValueError, match="one of none, selective, full"):
        enable_checkpointing(load_student(tiny_mla), "some")
