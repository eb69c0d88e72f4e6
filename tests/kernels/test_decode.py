"""The absorbed split-KV decode over the latent cache against its references (docs/kernels.md, "Decode"): fp32 and
16-bit, ragged lengths and empty splits, no per-head keys or values built, the latent-cache model's entry point."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, FP32_ATOL, TOLERANCE, decode_inputs, max_abs_err
from torch.utils._python_dispatch import TorchDispatchMode

from mha2mla.kernels import (
    latent_cache_decode,
    mla_decode,
    mla_decode_latent,
    mla_decode_reference,
    mla_decode_unabsorbed_reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_latent_cache_decode_backends_agree(dtype):
    """The model-facing entry point: the split-KV kernel and the cache-layout PyTorch reference give the same
    o_lat over one LatentCache layer (ragged rows, stale data past each row's length), and both equal the fp32
    ground truth ``mla_decode_latent`` reference."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, rank, d_rope, capacity = 3, 4, 24, 8, 80
    layer = torch.randn(batch, capacity, rank + d_rope, generator=gen).to(DEVICE, dtype)  # (B, T_max, r + d_r)
    query = torch.randn(batch, heads, rank + d_rope, generator=gen).to(DEVICE, dtype)
    lengths = torch.tensor([70, 1, 33], device=DEVICE)
    max_length, scale = 70, 0.3
    kernel = latent_cache_decode(query, layer, lengths, max_length, rank, scale, backend="triton")
    torch_path = latent_cache_decode(query, layer, lengths, max_length, rank, scale, backend="reference")
    keys = layer[:, :max_length]
    truth, _ = mla_decode_latent(query[..., :rank], query[..., rank:], keys[..., :rank], keys[..., rank:], lengths,
                                 scale, backend="reference")
    assert kernel.shape == torch_path.shape == (batch, heads, rank) and kernel.dtype == torch_path.dtype == dtype
    atol = FP32_ATOL if dtype == torch.float32 else TOLERANCE[dtype][0]
    torch.testing.assert_close(kernel.float(), truth, atol=atol, rtol=0 if dtype == torch.float32 else 5e-2)
    torch.testing.assert_close(torch_path.float(), truth, atol=atol, rtol=0 if dtype == torch.float32 else 5e-2)


# --------------------------------------------------------------------------------------------- decode

DECODE_CASES = [  # (B, H, T, d_n, d_r, d_v, r, lengths, num_splits)
    (1, 1, 16, 16, 16, 16, 16, [16], None),
    (3, 4, 100, 16, 8, 16, 24, [100, 1, 37], None),
    (3, 4, 100, 16, 8, 16, 24, [100, 1, 37], 3),  # splits beyond a short sequence's end are empty
    (2, 3, 77, 12, 8, 10, 40, [77, 50], 1),  # odd dims, one split
    (2, 20, 64, 8, 16, 8, 20, [64, 33], 8),  # more heads than one head tile: two programs per split
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}T{c[2]}r{c[6]}s{c[8]}")
def test_decode_fp32_matches_unabsorbed_reference(case):
    batch, heads, max_len, d_nope, d_rope, d_v, rank, lengths, splits = case
    q_nope, q_pe, cache, w_uk, w_uv = decode_inputs(batch, heads, max_len, d_nope, d_rope, d_v, rank)
    seqlens = torch.tensor(lengths, device=DEVICE, dtype=torch.int32)
    scale = (d_nope + d_rope) ** -0.5
    got = mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale, num_splits=splits, backend="triton")
    want = mla_decode_unabsorbed_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale)
    absorbed = mla_decode_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, scale)
    assert got.shape == (batch, heads, d_v)
    assert max_abs_err(got, want) <= FP32_ATOL
    assert max_abs_err(absorbed, want) <= FP32_ATOL
    # rows past cache_seqlens are never read: poisoning them changes nothing
    poisoned = cache.clone()
    for b, length in enumerate(lengths):
        poisoned[b, length:] = float("nan")
    again = mla_decode(q_nope, q_pe, poisoned, seqlens, w_uk, w_uv, scale, num_splits=splits, backend="triton")
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_16bit(dtype):
    q_nope, q_pe, cache, w_uk, w_uv = decode_inputs(2, 4, 90, 16, 8, 16, 24, dtype=dtype)
    seqlens = torch.tensor([90, 41], device=DEVICE)
    got = mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 0.2, backend="triton")
    want = mla_decode_unabsorbed_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 0.2)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


class TensorRecorder(TorchDispatchMode):
    """Records (op, shape, bytes) of every tensor any aten op produces, allocations included."""

    def __init__(self):
        super().__init__()
        self.tensors: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.Tensor):
                self.tensors.append((str(func), tuple(item.shape), item.numel() * item.element_size()))
        return result

    def largest(self):
        return max(self.tensors, key=lambda entry: entry[2])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_decode_never_builds_per_head_keys_or_values(backend):
    """Record every tensor produced during a decode call (under the interpreter this includes the
    interpreter's own host copies of the arguments). Per-head keys or values for the cached tokens take
    at least B*H*T*min(d_n, d_v) fp32 values; the whole cache buffer takes B*(T + spare)*(r + d_r),
    which these dims make smaller. The absorbed decode never produces a tensor that large; the
    un-absorbed oracle (what transformers does) does, which shows the detector can fail."""
    batch, heads, max_len, d_nope, d_rope, d_v, rank = 2, 4, 96, 16, 8, 16, 24
    per_head_kv_bytes = batch * heads * max_len * min(d_nope, d_v) * 4
    q_nope, q_pe, cache, w_uk, w_uv = decode_inputs(batch, heads, max_len, d_nope, d_rope, d_v, rank)
    assert cache.untyped_storage().nbytes() < per_head_kv_bytes
    seqlens = torch.tensor([96, 60], device=DEVICE)

    with TensorRecorder() as absorbed:
        mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 0.25, backend=backend)
    assert absorbed.tensors, "the recorder saw no op"
    assert absorbed.largest()[2] < per_head_kv_bytes, absorbed.largest()
    per_head_kv_shapes = {(batch, heads, max_len, d) for d in (d_nope, d_v, d_nope + d_rope)}
    assert not any(shape in per_head_kv_shapes for _, shape, _ in absorbed.tensors)

    with TensorRecorder() as unabsorbed:
        mla_decode_unabsorbed_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 0.25)
    assert unabsorbed.largest()[2] >= per_head_kv_bytes
    assert any(shape in per_head_kv_shapes for _, shape, _ in unabsorbed.tensors)


def test_decode_entry_point_takes_only_latent_cache_and_absorbed_factors(tmp_path):
    """The decode kernel's tensor arguments are the absorbed queries, the latent cache rows and the
    sequence lengths; with factors read from ``absorbed.safetensors`` it matches the un-absorbed path."""
    import inspect

    from mha2mla.io.mla_checkpoint import load_absorbed
    from mha2mla.kernels.decode import _decode_split_kernel
    from mha2mla.modeling.absorbed import write_absorbed
    from tests.common import tiny_deepseek_config

    config = tiny_deepseek_config(num_layers=1)
    heads, d_nope, d_v, rank = 4, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    kv_b = torch.randn(heads * (d_nope + d_v), rank) * rank**-0.5
    write_absorbed(tmp_path, {"model.layers.0.self_attn.kv_b_proj.weight": kv_b}, config)
    index, tensors = load_absorbed(tmp_path, device=DEVICE)
    w_uk, w_uv = tensors["layers.0.w_uk"], tensors["layers.0.w_uv"]
    q_nope, q_pe, cache, _, _ = decode_inputs(2, heads, 40, d_nope, config.qk_rope_head_dim, d_v, rank)
    assert cache.shape[-1] == index["cache_values_per_token_per_layer"]
    seqlens = torch.tensor([40, 9], device=DEVICE)
    got = mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, index["softmax_scale"], backend="triton")
    want = mla_decode_unabsorbed_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, index["softmax_scale"])
    assert max_abs_err(got, want) <= FP32_ATOL
    pointer_args = list(inspect.signature(_decode_split_kernel.fn).parameters)[:7]
    assert pointer_args == ["QL", "QP", "C", "KP", "SEQ_LEN", "O_PART", "LSE_PART"]
