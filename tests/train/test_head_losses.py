"""The LM and KL losses against the lm_head in chunks (mha2mla/train/head_losses.py) equal the losses on whole
logits: values and gradients (hidden states, lm_head weight, and every trainable parameter of a tiny model's step),
in float32 and under bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import build_source

from mha2mla.train import LoraSettings, losses
from mha2mla.train.data.packing import pack_token_lists, target_mask
from mha2mla.train.head_losses import final_hidden, head_losses, micro_batch_losses
from mha2mla.train.model.student import load_student
from mha2mla.train.model.teacher import load_teacher
from mha2mla.train.model.trainable import make_trainable


def _whole(hidden, weight, teacher_hidden, teacher_weight, ids, mask, lm_weight, kl_weight, temperature):
    """The reference: whole (B, L, V) logits, then logit_losses."""
    logits = F.linear(hidden, weight)
    teacher = None if teacher_hidden is None else F.linear(teacher_hidden, teacher_weight)
    return losses.logit_losses(logits, teacher, ids, mask, lm_weight, kl_weight, temperature)


@pytest.mark.parametrize("temperature, chunk, teacher", [(1.0, 5, True), (2.0, 7, True), (1.0, 4, False)])
def test_head_losses_equal_whole_logits_losses_and_gradients(temperature, chunk, teacher):
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 9, 6, dtype=torch.float64), torch.randn(13, 6, dtype=torch.float64)
    teacher_hidden = torch.randn(3, 9, 4, dtype=torch.float64) if teacher else None
    teacher_weight = torch.randn(13, 4, dtype=torch.float64) if teacher else None
    ids, mask = torch.randint(0, 13, (3, 9)), torch.rand(3, 8) > 0.3
    lm_weight, kl_weight = (0.3, 0.7) if teacher else (1.0, 0.0)
    results, grads = [], []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        args = (h, w, teacher_hidden, teacher_weight, ids, mask, lm_weight, kl_weight, temperature)
        out = head_losses(*args, chunk=chunk) if fused else _whole(*args)  # chunk 5 or 7 over 24 positions: a short last
        out[0].backward()
        results.append(torch.stack([value.detach().double() for value in out]))
        grads.append((h.grad, w.grad))
    # both sum in float32 (chunk_losses), in another order
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-8)
    for fused, whole in zip(grads[0], grads[1]):
        assert whole.abs().max() > 1e-3
        torch.testing.assert_close(fused, whole, rtol=1e-6, atol=1e-8)
    assert grads[0][0][:, -1].abs().max() == 0  # the last position of a row predicts nothing


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_mla):
    """The tiny MLA student (LoRA) and a source teacher with the same vocabulary, and a packed batch."""
    folder = tmp_path_factory.mktemp("pair")
    teacher = load_teacher(str(build_source(folder / "source", vocab_size=384)))
    torch.manual_seed(3)
    student = make_trainable(load_student(tiny_mla), LoraSettings(rank=4))
    with torch.no_grad():  # a trained-looking adapter, so the LoRA B matrices get gradients through A too
        for name, param in student.named_parameters():
            if param.requires_grad and "lora_B" in name:
                param.normal_(0, 0.05)
    batch = pack_token_lists([torch.randint(1, 256, (n,)).tolist() for n in (20, 35, 9, 40)], seq_len=24).rows(slice(0, 4))
    return student, teacher, batch


def _step(student, teacher, batch, whole: bool, dtype: torch.dtype):
    student.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = micro_batch_losses(student, student, teacher, batch, target_mask(batch["position_ids"]), 0.6, 2.0,
                                 whole_logits=whole)
    out[0].backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.requires_grad}
    return torch.stack([value.detach().float() for value in out]), grads


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_models_step_gives_the_same_losses_and_gradients_either_way(pair, dtype, rtol):
    """float32: equal to rounding. bf16 autocast: both compute every matmul in bf16 and differ only in the order
    of the lm_head's per-chunk matmuls, so to bf16 rounding."""
    student, teacher, batch = pair
    chunked, chunked_grads = _step(student, teacher, batch, whole=False, dtype=dtype)
    whole, whole_grads = _step(student, teacher, batch, whole=True, dtype=dtype)
    torch.testing.assert_close(chunked, whole, rtol=rtol, atol=1e-6)
    assert chunked_grads.keys() == whole_grads.keys() and len(whole_grads) > 4
    for name, grad in whole_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked_grads[name], grad, rtol=rtol, atol=rtol * grad.abs().max().item(), msg=name)


def test_final_hidden_projects_nothing_and_is_what_the_lm_head_reads(pair):
    student, _, batch = pair
    seen = {}
    handle = student.get_output_embeddings().register_forward_hook(lambda _m, args, out: seen.update(i=args[0], o=out))
    try:
        with torch.no_grad():
            hidden = final_hidden(student, student, batch)
            logits = student(**batch, use_cache=False).logits
    finally:
        handle.remove()
    assert hidden.shape == (*batch["input_ids"].shape, student.config.hidden_size)
    torch.testing.assert_close(F.linear(hidden, student.get_output_embeddings().weight), logits, rtol=1e-6, atol=1e-6)
    assert seen["i"] is not None and seen["o"].shape[-1] == student.config.vocab_size



@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_held_out_perplexity_against_the_lm_head_in_chunks_equals_the_whole_logits_one(pair, dtype, rtol):
    """Recovery's held-out evaluation scores against the lm_head in chunks (no (B, L, V) logits): the same
    perplexity as ``batch_nll`` on the whole logits, the FSDP path, which scores segment starts out as well."""
    from accelerate import Accelerator

    from mha2mla.train.data.packing import pack_token_lists
    from mha2mla.train.evaluate import packed_perplexity

    student = pair[0]
    torch.manual_seed(5)
    rows = pack_token_lists([torch.randint(1, 256, (n,)).tolist() for n in (30, 17, 44, 25, 12, 50)], seq_len=24)
    accelerator = Accelerator(cpu=True)
    student.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        chunked = packed_perplexity(student, rows, 2, accelerator, sharded=False)
        whole = packed_perplexity(student, rows, 2, accelerator, sharded=True)
    assert student.training  # put back as it was
    assert len(rows) >= 4 and 1 < whole < 1e4
    assert chunked == pytest.approx(whole, rel=rtol)
