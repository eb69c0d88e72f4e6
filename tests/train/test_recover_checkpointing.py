"""Activation checkpointing (``--activation-checkpointing``): the same losses and gradients as keeping every
activation (it only recomputes them), through LoRA and full-layer training; a run with it resumes one without it
(not an outcome setting) and the memory estimate counts one layer's activations instead of all."""

from __future__ import annotations

import json

import pytest
import torch

from mha2mla.train import LoraSettings, RecoverConfig
from mha2mla.train.data.packing import pack_token_lists, target_mask
from mha2mla.train.head_losses import micro_batch_losses
from mha2mla.train.memory import estimate, meta_counts
from mha2mla.train.model.student import load_student
from mha2mla.train.model.trainable import make_trainable


def _losses_and_grads(model_folder, lora: LoraSettings | None, checkpointing: bool):
    torch.manual_seed(0)
    student = load_student(model_folder)
    if checkpointing:
        student.activation_checkpointing_enable()
    student = make_trainable(student, lora, layers=lora is None)
    student.train()
    torch.manual_seed(1)
    batch = pack_token_lists([torch.randint(1, 256, (n,)).tolist() for n in (30, 50, 17)], seq_len=24).rows(slice(0, 4))
    loss = micro_batch_losses(student, student, None, batch, target_mask(batch["position_ids"]), 0.0, 1.0)[0]
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in student.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [LoraSettings(rank=4, dropout=0.1), None], ids=["lora with dropout", "full layers"])
def test_checkpointing_gives_the_same_losses_and_gradients(tiny_mla, lora):
    loss, grads = _losses_and_grads(tiny_mla, lora, checkpointing=False)
    loss_checkpointed, grads_checkpointed = _losses_and_grads(tiny_mla, lora, checkpointing=True)
    torch.testing.assert_close(loss_checkpointed, loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == grads_checkpointed.keys() and len(grads) > 4
    for name, grad in grads.items():
        torch.testing.assert_close(grads_checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_checkpointing_is_not_an_outcome_setting_and_lowers_the_estimate(tiny_mla, tmp_path):
    # eight layers: checkpointing pays once the layers kept outweigh the one recomputed at a time
    model = tmp_path / "model"
    model.mkdir()
    model_config = json.loads((tiny_mla / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**model_config, "num_hidden_layers": 8}))
    settings = {"model": str(model), "data": ["corpus.txt"], "out": str(tmp_path / "out"), "max_steps": 2,
                "seq_len": 64, "full_layers": True}
    plain = RecoverConfig(**settings, activation_checkpointing="none")
    selective, checkpointed = (RecoverConfig(**settings, activation_checkpointing=mode) for mode in ("selective", "full"))
    assert plain.outcome_fields() == selective.outcome_fields() == checkpointed.outcome_fields()
    plain_estimate, selective_estimate, checkpointed_estimate = (
        estimate(config, meta_counts(config), config.total_steps()) for config in (plain, selective, checkpointed))
    assert checkpointed_estimate.activations < selective_estimate.activations < plain_estimate.activations
    assert checkpointed_estimate.weights == selective_estimate.weights == plain_estimate.weights
