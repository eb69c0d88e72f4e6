"""Layer-wise distillation (mha2mla/train/layer_losses.py): zero on an exact conversion, positive and with a gradient
on a cut one, and the run's objectives refusing a run without a teacher."""

from __future__ import annotations

import json

import pytest
import torch
from common import build_source
from transformers import AutoModelForCausalLM

from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert
from mha2mla.train import RecoverConfig
from mha2mla.train.layer_losses import _attention_inputs, attention_output_losses, hidden_state_losses, layer_outputs

HEAD_DIM = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An MQA source, its exact conversion at full capacity and a cut one (rank 8 latent, 8-dim rope)."""
    root = tmp_path_factory.mktemp("layer_losses")
    source = build_source(root / "source", "llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=True)
    exact, cut = root / "exact", root / "cut"
    convert(source, exact, ConvertConfig(calib=None, profile="exact", kv_lora_rank=2 * HEAD_DIM + 1,
                                         rope_dim=HEAD_DIM), progress=False)
    convert(source, cut, ConvertConfig(calib=None, profile="exact", kv_lora_rank=9, rope_dim=8), progress=False)
    load = lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
    return load(source), load(exact), load(cut)


def _batch():
    """Two packed rows: positions restart where a second document begins."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    return {"input_ids": ids, "position_ids": positions}


def _hidden_state_loss(student, teacher, batch):
    with layer_outputs(student) as student_layers:
        student(**batch, use_cache=False)
    with torch.no_grad(), layer_outputs(teacher) as teacher_layers:
        teacher(**batch, use_cache=False)
    assert len(student_layers) == len(teacher_layers) == student.config.num_hidden_layers
    return hidden_state_losses(student_layers, teacher_layers)


def test_exact_conversion_has_zero_layer_losses(models):
    source, exact, _ = models
    batch = _batch()
    assert attention_output_losses(exact, source, batch).item() < 1e-9
    assert _hidden_state_loss(exact, source, batch).item() < 1e-9


def test_cut_conversion_has_positive_layer_losses_with_gradients(models):
    source, _, cut = models
    batch = _batch()
    cut.zero_grad()
    loss = attention_output_losses(cut, source, batch)
    assert loss.item() > 1e-4
    loss.backward()
    attention = cut.model.layers[0].self_attn
    assert attention.kv_b_proj.weight.grad.abs().sum() > 0
    assert cut.model.layers[0].mlp.down_proj.weight.grad is None  # the MLPs are not in the teacher-forced loss
    assert _hidden_state_loss(cut, source, batch).item() > 1e-4


def test_the_teacher_forced_attention_keeps_packed_documents_apart(models):
    """The attention arguments read from the student's decoder hold the packed rows' mask: inputs that differ only
    in the first document give the same outputs in the second, and different ones in the first."""
    _, _, cut = models
    arguments = _attention_inputs(cut, _batch())
    first = torch.randn(2, 24, cut.config.hidden_size, generator=torch.Generator().manual_seed(0))
    second = first.clone()
    second[:, :10] += 1.0
    attention = cut.model.layers[0].self_attn
    with torch.no_grad():
        a, b = (attention(hidden_states=x, **arguments)[0] for x in (first, second))
    assert torch.allclose(a[:, 10:], b[:, 10:], atol=1e-6)
    assert not torch.allclose(a[:, :10], b[:, :10], atol=1e-3)


@pytest.mark.parametrize("overrides", [{"layer_distill_weight": 0.5}, {"objective": "attention_outputs"}])
def test_layer_wise_objectives_need_a_teacher(overrides, tmp_path):
    with pytest.raises(ValueError, match="give --teacher"):
        RecoverConfig(model=str(tmp_path), out=str(tmp_path / "out"), max_steps=1, **overrides)


def _run(tiny_mla, tmp_path, **settings) -> tuple[list[dict], dict, dict]:
    """A 4-step recovery of the tiny MLA model distilled from a tiny source with its shapes: the step records and the
    weights before and after."""
    from common import SAMPLE_TEXT

    from mha2mla.train import recover

    teacher = build_source(tmp_path / "source", vocab_size=384)
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 6)
    out = tmp_path / "out"
    config = RecoverConfig(model=str(tiny_mla), data=[str(tmp_path / "text.txt")], out=str(out), teacher=str(teacher),
                           seq_len=32, batch_size=2, max_steps=4, learning_rate=1e-2, eval_sequences=2, eval_every=0,
                           save_every=0, **settings)
    recover(config, show_progress=False)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    before = AutoModelForCausalLM.from_pretrained(tiny_mla).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    return [record for record in log if "loss" in record], before, after


def test_recover_with_the_attention_output_objective_trains_the_attentions_only(tiny_mla, tmp_path):
    steps, before, after = _run(tiny_mla, tmp_path, objective="attention_outputs", full_layers=True)
    assert len(steps) == 4 and all(step["loss"] > 0 and step["lm_loss"] == 0 for step in steps)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert any(".self_attn." in name for name in changed)
    assert not any(".mlp." in name or "embed" in name or "lm_head" in name for name in changed)


def test_recover_with_hidden_state_distillation_adds_the_layer_term(tiny_mla, tmp_path):
    steps, _, _ = _run(tiny_mla, tmp_path, distill_weight=1.0, layer_distill_weight=1.0, full_layers=True)
    assert len(steps) == 4 and all(step["loss"] > step["distill_loss"] > 0 for step in steps)
