"""Recovery objectives beyond the LM loss and the logit KL: layer-wise hidden-state distillation (docs/recover.md,
"Objectives") on a tiny source converted to MLA with a narrow latent, so the student starts measurably off."""

from __future__ import annotations

import json

import pytest
import torch
from common import SAMPLE_TEXT, build_source

from mha2mla.convert.options import ConvertOptions
from mha2mla.convert.pipeline import convert
from mha2mla.train import RecoverConfig, recover
from mha2mla.train.losses import hidden_state_loss


def test_hidden_state_loss_is_zero_only_for_matching_states():
    torch.manual_seed(0)
    states = tuple(torch.randn(2, 5, 8) * scale for scale in (1.0, 3.0, 0.1))
    assert hidden_state_loss(states, states) == 0
    moved = (states[0], states[1] + 0.3 * torch.randn(2, 5, 8), states[2])  # only layer 1's output differs
    assert hidden_state_loss(moved, states) > 0.001
    # the embeddings (index 0) are the same weights in both models and never compared
    assert hidden_state_loss((states[0] + 1, *states[1:]), states) == 0
    with pytest.raises(ValueError, match="layers"):
        hidden_state_loss(states[:2], states)


@pytest.fixture(scope="module")
def narrow_pair(tmp_path_factory):
    """A random source and its weight-only conversion at a quarter of the KV width (the student)."""
    folder = tmp_path_factory.mktemp("objectives")
    source = build_source(folder / "source", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    student = folder / "student"
    convert(source, student, ConvertOptions(kv_budget=0.25, calib="none", dtype="float32"), progress=False)
    (folder / "text.txt").write_text(SAMPLE_TEXT * 6)
    return source, student, folder / "text.txt"


def _run(pair, out, **overrides) -> dict:
    source, student, text = pair
    settings = dict(model=str(student), data=[str(text)], out=str(out), teacher=str(source), seq_len=32,
                    batch_size=4, max_steps=25, learning_rate=3e-3, full_attention=True, distill_weight=1.0,
                    eval_sequences=4, eval_every=0, save_every=0, seed=0)
    return recover(RecoverConfig(**{**settings, **overrides}), show_progress=False)


def test_hidden_state_distillation_lowers_the_held_out_loss_and_the_state_gap(narrow_pair, tmp_path):
    report = _run(narrow_pair, tmp_path / "hidden", hidden_distill_weight=1.0)
    first, last = report["evaluations"][0]["perplexity"], report["evaluations"][-1]["perplexity"]
    assert last < first
    log = [json.loads(line) for line in (tmp_path / "hidden" / "train_log.jsonl").read_text().splitlines()]
    steps = [record for record in log if "loss" in record]
    gaps = [record["hidden_loss"] for record in steps]
    assert len(gaps) == 25 and gaps[0] > 0
    assert sum(gaps[-5:]) < 0.8 * sum(gaps[:5])
    # the logged loss is the stated mixture: KL (distill weight 1) plus the hidden-state term
    assert steps[0]["loss"] == pytest.approx(steps[0]["distill_loss"] + gaps[0], rel=1e-5)


def test_hidden_state_distillation_needs_a_teacher(narrow_pair, tmp_path):
    with pytest.raises(ValueError, match="needs a teacher"):
        RecoverConfig(model=str(narrow_pair[1]), data=[str(narrow_pair[2])], out=str(tmp_path / "o"), max_steps=1,
                      hidden_distill_weight=0.5)
