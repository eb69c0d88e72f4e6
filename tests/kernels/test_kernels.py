"""The training / prefill MLA kernel against its reference, the backend choice, and the GPU-only checks (docs/kernels.md).

On CPU the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a GPU
the same tests run natively. Shapes stay tiny (<= 4 heads, <= 128 tokens) except in `gpu` tests.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_checks import (
    DEVICE,
    FP32_ATOL,
    TOLERANCE,
    assert_matches_reference,
    attention_inputs,
    decode_inputs,
    forward_and_grads,
    max_abs_err,
)

from mha2mla import UserError
from mha2mla.kernels import (
    choose_backend,
    decode_attention_backend,
    flash_mla_attention,
    flash_mla_reference,
    mla_decode,
    mla_decode_unabsorbed_reference,
)
from mha2mla.kernels.reference import segment_ids_from_cu_seqlens, segment_ids_from_position_ids

# --------------------------------------------------------------------------- training / prefill kernel

SHAPES = [  # (B, H, T, d_n, d_r, d_v)
    (1, 1, 16, 16, 16, 16),  # one tile, power-of-two dims
    (2, 3, 70, 12, 8, 10),  # odd dims, d_qk != d_v, partial tiles
    (1, 4, 128, 24, 8, 20),  # 4 heads, 128 tokens, several tiles
    (2, 2, 33, 0, 16, 16),  # no no-rope part at all (full-capacity rope)
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_fp32_matches_reference(shape):
    batch, heads, tokens, d_nope, d_rope, d_v = shape
    inputs = attention_inputs(batch, heads, tokens, tokens, d_nope, d_rope, d_v)
    errors = assert_matches_reference(inputs, softmax_scale=(d_nope + d_rope) ** -0.5)
    assert max(errors.values()) <= FP32_ATOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_flash_16bit_matches_reference(dtype):
    inputs = attention_inputs(2, 3, 50, 50, 12, 8, 10, dtype=dtype)
    atol, rtol = TOLERANCE[dtype]
    assert_matches_reference(inputs, atol=atol, rtol=rtol)


def test_flash_non_causal_and_cache_offset():
    """Tq < Tk: queries are the last Tq positions (prefill after a cache); and non-causal attention."""
    inputs = attention_inputs(1, 2, 20, 45, 12, 8, 16)
    assert_matches_reference(inputs, causal=True)
    assert_matches_reference(inputs, causal=False)


def test_flash_packed_sequences_equal_separate_runs():
    """Packing three sequences in one row (segment ids, or cu_seqlens) gives, per sequence, exactly
    what the reference gives for that sequence alone: an oracle independent of the masking code."""
    lengths = [17, 40, 23]
    inputs = attention_inputs(1, 2, sum(lengths), sum(lengths), 12, 8, 10)
    cu_seqlens = torch.tensor([0, 17, 57, 80], device=DEVICE)
    out, grads, grad_out = forward_and_grads(flash_mla_attention, inputs, backend="triton", cu_seqlens=cu_seqlens)
    q, k_nope, k_pe, v = inputs
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        pieces = (q[:, :, part], k_nope[:, :, part], k_pe[:, part], v[:, :, part])
        ref, ref_grads = forward_and_grads(flash_mla_reference, pieces, grad_out[:, :, part])[:2]
        assert max_abs_err(out[:, :, part], ref) <= FP32_ATOL
        got_grads = (grads[0][:, :, part], grads[1][:, :, part], grads[2][:, part], grads[3][:, :, part])
        for got, want in zip(got_grads, ref_grads):
            assert max_abs_err(got, want) <= FP32_ATOL
        start += length
    # segment ids with padding (-1) in a batch of two rows, against the masked reference
    segments = torch.tensor([[0] * 30 + [1] * 50, [-1] * 11 + [4] * 60 + [-1] * 9], device=DEVICE)
    assert_matches_reference(inputs=attention_inputs(2, 3, 80, 80, 12, 8, 10, seed=3), segment_ids=segments)


@pytest.mark.parametrize("heads_per_program", [1, 2, 3])
def test_flash_rope_key_gradient_summed_across_head_groups(heads_per_program):
    """Split the heads of the dK/dV pass over several programs: each head group stores its partial d k_pe and
    the partials are added after the kernel (3 heads per program: one group, no reduction). No atomics."""
    import inspect
    from dataclasses import replace

    from mha2mla.kernels.flash_mla import flash_mla_triton
    from mha2mla.kernels.flash_mla_kernels import _flash_mla_bwd_dkv_kernel
    from mha2mla.kernels.tuning import INTERPRETER_CONFIG

    assert "atomic" not in inspect.getsource(_flash_mla_bwd_dkv_kernel.fn)
    config = replace(INTERPRETER_CONFIG, heads_per_program=heads_per_program)
    inputs = attention_inputs(2, 3, 40, 40, 12, 8, 10, seed=5)
    out, grads, grad_out = forward_and_grads(lambda *t: flash_mla_triton(*t, 20**-0.5, config=config), inputs)
    ref, ref_grads, _ = forward_and_grads(flash_mla_reference, inputs, grad_out, softmax_scale=20**-0.5)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert max_abs_err(got, want) <= FP32_ATOL


def test_flash_accepts_views_of_one_key_tensor():
    """transformers' layout: key (B, H, T, d_n + d_r) whose rope part is the same in every head. The
    kernel takes strided views (no copy) and the shared key's gradient flows back summed over heads."""
    batch, heads, tokens, d_nope, d_rope, d_v = 2, 3, 30, 12, 8, 10
    q, k_nope, k_pe, v = attention_inputs(batch, heads, tokens, tokens, d_nope, d_rope, d_v, seed=7)

    def via_views(q, k_nope, k_pe, v):
        key = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1, -1)], dim=-1)  # (B, H, T, d_n + d_r)
        return flash_mla_attention(q, key[..., :d_nope], key[:, 0, :, d_nope:], v, backend="triton")

    out, grads, grad_out = forward_and_grads(via_views, (q, k_nope, k_pe, v))
    ref, ref_grads, _ = forward_and_grads(flash_mla_reference, (q, k_nope, k_pe, v), grad_out)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert max_abs_err(got, want) <= FP32_ATOL


def test_segment_ids_helpers():
    assert segment_ids_from_cu_seqlens(torch.tensor([0, 2, 5, 6])).tolist() == [[0, 0, 1, 1, 1, 2]]
    positions = torch.tensor([[0, 1, 0, 1, 2, 0], [3, 4, 5, 6, 7, 8]])
    assert segment_ids_from_position_ids(positions).tolist() == [[0, 0, 1, 1, 1, 2], [0] * 6]


def test_attention_segment_ids_from_masks_and_positions():
    from mha2mla.kernels.attention import attention_segment_ids

    assert attention_segment_ids(2, 5, 5, position_ids=torch.arange(5)[None].expand(2, 5)) is None  # plain causal
    packed = attention_segment_ids(1, 5, 5, position_ids=torch.tensor([[0, 1, 0, 1, 2]]))
    assert packed.tolist() == [[0, 0, 1, 1, 1]]
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    assert attention_segment_ids(1, 5, 5, attention_mask=mask).tolist() == [[0, 0, 0, -1, -1]]
    mask.copy_(torch.tensor([[0, 1, 1, 1, 1]]))  # changed in place: the memo must not answer
    assert attention_segment_ids(1, 5, 5, attention_mask=mask).tolist() == [[-1, 0, 0, 0, 0]]
    other = torch.tensor([[0, 0, 1, 1, 1]])  # another tensor, same shape
    assert attention_segment_ids(1, 5, 5, attention_mask=other).tolist() == [[-1, -1, 0, 0, 0]]
    assert attention_segment_ids(1, 2, 5, attention_mask=other).tolist() == [[-1, -1, 0, 0, 0]]  # cache


def test_backend_choice(monkeypatch):
    x = torch.zeros(1, device=DEVICE)
    monkeypatch.setenv("MHA2MLA_KERNELS", "reference")
    assert choose_backend(x) == "reference"
    monkeypatch.setenv("MHA2MLA_KERNELS", "auto")
    expected = "triton" if (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") else "reference"
    assert choose_backend(x) == expected
    monkeypatch.setenv("MHA2MLA_KERNELS", "bogus")
    with pytest.raises(ValueError):
        choose_backend(x)


def test_decode_attention_backend_is_decided_in_one_place(monkeypatch):
    """The latent-cache model's choice: torch is always the reference; auto takes the kernel on CUDA only (and
    follows MHA2MLA_KERNELS); kernel insists on Triton and is a UserError where it cannot run."""
    monkeypatch.delenv("MHA2MLA_KERNELS", raising=False)
    assert decode_attention_backend("cpu", "torch") == "reference"
    assert decode_attention_backend("cpu", "auto") == "reference"  # never the slow interpreter by itself
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode_attention_backend("cpu", "kernel") == "triton"
    monkeypatch.setenv("MHA2MLA_KERNELS", "triton")
    assert decode_attention_backend("cpu", "auto") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="MHA2MLA_KERNELS=triton"):
        decode_attention_backend("cpu", "auto")
    with pytest.raises(UserError, match="cannot run on cpu"):
        decode_attention_backend("cpu", "kernel")
    with pytest.raises(UserError, match="not one of auto, torch, kernel"):
        decode_attention_backend("cpu", "flash")
    if torch.cuda.is_available():
        monkeypatch.setenv("MHA2MLA_KERNELS", "auto")
        assert decode_attention_backend("cuda", "auto") == "triton"
        monkeypatch.setenv("MHA2MLA_KERNELS", "reference")
        assert decode_attention_backend("cuda", "auto") == "reference"


# -------------------------------------------------------------------------------------- GPU-only checks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_deepseek_shapes(dtype):
    """DeepSeek-V3 head dims (d_n 128, d_r 64, d_v 128), 1k tokens, natively on the GPU."""
    inputs = attention_inputs(1, 8, 1024, 1024, 128, 64, 128, dtype=dtype)
    atol, rtol = TOLERANCE[dtype]
    assert_matches_reference(inputs, atol=atol, rtol=rtol, softmax_scale=192**-0.5)
    q_nope, q_pe, cache, w_uk, w_uv = decode_inputs(4, 16, 4096, 128, 64, 128, 512, dtype=dtype)
    seqlens = torch.tensor([4096, 1, 2049, 3000], device=DEVICE)
    got = mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 192**-0.5, backend="triton")
    want = mla_decode_unabsorbed_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 192**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_gpu_fp32_smollm2_shapes():
    """SmolLM2-MLA dims (H 9, d_n 48, d_r 16, d_v 64) in fp32 with IEEE dots: the 1e-5 bound natively."""
    inputs = attention_inputs(2, 9, 300, 300, 48, 16, 64)
    errors = assert_matches_reference(inputs, softmax_scale=64**-0.5)
    assert max(errors.values()) <= FP32_ATOL
