"""Launch settings per shape (mha2mla/kernels/tuning.py): the selection logic as plain Python, and the kernels run
under the interpreter with the configs it chooses for the GPU (docs/kernels.md, "Tiles, warps and splits")."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import DEVICE, FP32_ATOL, attention_inputs, decode_inputs, forward_and_grads, max_abs_err

from mha2mla.kernels import flash_mla_reference, mla_decode, mla_decode_unabsorbed_reference, tuning

SMS = tuning.H200_MULTIPROCESSORS
DECODE_BENCH = [  # (B, H, T, r) of benchmarks/kernels_bench.py's decode shapes
    (32, 128, 4096, 512), (64, 32, 8192, 512), (1, 128, 32768, 512), (64, 9, 4096, 128), (64, 9, 4096, 480)]


def test_candidates_per_head_width():
    assert tuning.flash_candidates(64, 16, 64, interpreting=True) == [tuning.INTERPRETER_CONFIG]
    narrow = tuning.flash_candidates(64, 32, 64, interpreting=False)  # SmolLM2-MLA: 64 + 32 + 64
    wide = tuning.flash_candidates(128, 64, 128, interpreting=False)  # DeepSeek: 128 + 64 + 128
    assert tuning.forward_part(narrow[0]) == tuning.NARROW_FORWARD[0]
    assert tuning.forward_part(wide[0]) == tuning.WIDE_FORWARD[0]
    assert tuning.backward_part(wide[0]) == tuning.WIDE_BACKWARD[0]
    for config in narrow + wide:
        for block in (config.block_m, config.block_n, config.bwd_block_m, config.bwd_block_n):
            assert block >= 16 and block & (block - 1) == 0  # tl.dot: powers of two >= 16
    assert len(set(narrow)) == len(narrow) and len(set(wide)) == len(wide)
    mixed = tuning.combine(narrow[0], narrow[2])
    assert tuning.forward_part(mixed) == tuning.forward_part(narrow[0])
    assert tuning.backward_part(mixed) == tuning.backward_part(narrow[2])


def test_shape_key_buckets_lengths_but_not_head_dims():
    key = tuning.flash_shape_key("forward", 4, 9, 2000, 2000, 64, 16, 64, "torch.bfloat16", True, False)
    assert key == tuning.flash_shape_key("forward", 4, 9, 2048, 2048, 64, 16, 64, "torch.bfloat16", True, False)
    assert key != tuning.flash_shape_key("forward", 4, 9, 4096, 4096, 64, 16, 64, "torch.bfloat16", True, False)
    assert key != tuning.flash_shape_key("forward", 4, 9, 2048, 2048, 64, 32, 64, "torch.bfloat16", True, False)
    assert key != tuning.flash_shape_key("backward", 4, 9, 2048, 2048, 64, 16, 64, "torch.bfloat16", True, False)


def test_autotune_switch(monkeypatch):
    monkeypatch.delenv("MHA2MLA_KERNELS_AUTOTUNE", raising=False)
    assert tuning.autotune_enabled(interpreting=False) and not tuning.autotune_enabled(interpreting=True)
    monkeypatch.setenv("MHA2MLA_KERNELS_AUTOTUNE", "0")
    assert not tuning.autotune_enabled(interpreting=False)


def test_config_cache_keeps_the_fastest_and_skips_failures():
    candidates = tuning.flash_candidates(64, 16, 64, interpreting=False)
    times = {candidates[0]: 3.0, candidates[1]: 1.0, candidates[2]: 2.0}
    calls = []

    def time_ms(config):
        calls.append(config)
        if config not in times:
            raise RuntimeError("out of shared memory")
        return times[config]

    cache = tuning.ConfigCache()
    assert cache.pick("k", candidates, time_ms) == candidates[1]
    assert cache.timings["k"][3] == math.inf and len(calls) == len(candidates)
    assert cache.pick("k", candidates, time_ms) == candidates[1] and len(calls) == len(candidates)  # cached
    failing = [candidates[3], tuning.combine(candidates[3], candidates[0])]
    with pytest.raises(RuntimeError, match="no MLA kernel config ran"):
        cache.pick("other", failing, time_ms)


def test_decode_splits_fill_the_gpu_in_one_wave():
    """At every kernels_bench decode shape the split count makes programs fill the 132 multiprocessors to >= 90%
    within whole waves, and a split never holds less than one cache tile."""
    for batch, heads, tokens, rank in DECODE_BENCH:
        block_h, block_n, _ = tuning.decode_blocks(heads, rank, interpreting=False)
        groups = -(-heads // block_h)
        splits = tuning.decode_num_splits(batch, groups, tokens, block_n, SMS)
        programs = batch * groups * splits
        waves = -(-programs // SMS)
        assert programs / (waves * SMS) >= 0.9, (batch, heads, tokens, splits)
        assert 1 <= splits <= -(-tokens // block_n)
    # batch 1, 128 heads, 32K context (4 head groups): 32 slices of 1K tokens, 128 programs (33 would take as long)
    assert tuning.decode_num_splits(1, 4, 32768, 32, SMS) == 32
    assert tuning.decode_num_splits(32, 4, 4096, 32, SMS) == 1  # 128 programs already fill the GPU
    assert tuning.decode_num_splits(1, 1, 40, 64, SMS) == 1  # one tile: nothing to split
    assert tuning.decode_num_splits(2, 1, 300, 16, None) == 2  # CPU: two slices, to exercise the merge


def splits_by_search(batch, groups, max_len, block_n, multiprocessors, overhead=2.0, max_waves=4):
    """The cost model searched over every split count (the oracle for decode_num_splits' few candidates)."""
    tiles = -(-max_len // block_n)
    programs = batch * groups
    costs = [(-(-programs * s // multiprocessors) * (-(-tiles // s) + overhead), s) for s in range(1, tiles + 1)
             if s == 1 or -(-programs * s // multiprocessors) <= max_waves]
    return min(costs)


def test_decode_splits_are_the_cost_models_best():
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        batch, groups, max_len, block = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (80, 9, 40000, 4))
        block_n = (16, 32, 64)[block - 1]
        got = tuning.decode_num_splits(batch, groups, max_len, block_n, SMS)
        tiles, programs = -(-max_len // block_n), batch * groups
        cost = -(-programs * got // SMS) * (-(-tiles // got) + 2.0)
        assert (cost, got) <= splits_by_search(batch, groups, max_len, block_n, SMS), (batch, groups, max_len, block_n)


def test_dkv_heads_per_program():
    assert tuning.dkv_heads_per_program(9, 4, 2048, 32, None) == 9  # CPU: one program walks every head
    assert tuning.dkv_heads_per_program(9, 4, 2048, 32, SMS) == 1  # GPU: one head per program
    assert tuning.dkv_heads_per_program(128, 1, 4096, 64, SMS) == 1  # 128 partials of 1 MiB each
    # partials past the cap: as few heads per program as keeps them under it (1 MiB per head, 64 MiB: 2 heads each)
    assert tuning.dkv_heads_per_program(128, 1, 4096, 64, SMS, max_partial_bytes=64 << 20) == 2
    assert tuning.dkv_heads_per_program(128, 8, 4096, 64, SMS, max_partial_bytes=4 << 20) == 128  # under one head's


@pytest.mark.parametrize("width", ["narrow", "wide"])
def test_flash_kernels_with_every_gpu_candidate(width):
    """Each GPU candidate's tiles (up to 128 x 128, partial tiles, 1 and 2 heads per dK/dV program) give the
    reference's output and gradients under the interpreter."""
    from dataclasses import replace

    from mha2mla.kernels.flash_mla import flash_mla_triton

    dims = (64, 16, 64) if width == "narrow" else (128, 64, 128)
    candidates = tuning.flash_candidates(*dims, interpreting=False)
    inputs = attention_inputs(1, 2, 150, 150, 12, 8, 10, seed=4)
    for index, config in enumerate(candidates):
        config = replace(config, heads_per_program=1 + index % 2)
        out, grads, grad_out = forward_and_grads(lambda *t, c=config: flash_mla_triton(*t, 0.25, config=c), inputs)
        ref, ref_grads, _ = forward_and_grads(flash_mla_reference, inputs, grad_out, softmax_scale=0.25)
        for got, want in zip((out, *grads), (ref, *ref_grads)):
            assert max_abs_err(got, want) <= FP32_ATOL, config


def test_autotuned_path_picks_and_caches_under_the_interpreter(monkeypatch):
    """The CUDA path's plumbing on the CPU: autotuning on, the GPU candidates, a timer that runs each launch once
    and reports made-up times. The forward and backward each keep their fastest candidate, cached per shape."""
    import mha2mla.kernels.flash_mla as flash_module

    candidates = tuning.flash_candidates(64, 16, 64, interpreting=False)
    fastest_forward, fastest_backward = candidates[2], candidates[1]
    scripted = iter([3.0, 2.0, 1.0, 4.0, 2.0, 1.0, 3.0, 4.0])  # forward candidates, then backward ones

    def fake_time(launch):
        launch()
        return next(scripted)

    monkeypatch.setattr(flash_module, "_TUNED", tuning.ConfigCache())
    monkeypatch.setattr(flash_module, "autotune_enabled", lambda interpreting: True)
    monkeypatch.setattr(flash_module, "flash_candidates", lambda *a: candidates)
    monkeypatch.setattr(flash_module, "_time_ms", fake_time)
    inputs = attention_inputs(1, 2, 70, 70, 12, 8, 10, seed=6)
    for _ in range(2):  # the second call is served from the cache (the scripted timer would run dry otherwise)
        out, grads, grad_out = forward_and_grads(lambda *t: flash_module.flash_mla_triton(*t, 0.3), inputs)
    ref, ref_grads, _ = forward_and_grads(flash_mla_reference, inputs, grad_out, softmax_scale=0.3)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert max_abs_err(got, want) <= FP32_ATOL
    chosen = {key[0]: config for key, config in flash_module._TUNED.best.items()}
    assert tuning.forward_part(chosen["forward"]) == tuning.forward_part(fastest_forward)
    assert tuning.backward_part(chosen["backward"]) == tuning.backward_part(fastest_backward)


def test_decode_with_the_gpu_split_count():
    """The split-KV decode with the split count chosen for an H200 at a small shape (19 slices of 16 rows,
    ragged lengths: some slices empty) matches the un-absorbed reference under the interpreter."""
    batch, heads, tokens = 2, 3, 300
    splits = tuning.decode_num_splits(batch, 1, tokens, 16, SMS)
    assert splits == 19
    q_nope, q_pe, cache, w_uk, w_uv = decode_inputs(batch, heads, tokens, 16, 8, 16, 24)
    seqlens = torch.tensor([300, 45], device=DEVICE)
    got = mla_decode(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 0.2, num_splits=splits, backend="triton")
    want = mla_decode_unabsorbed_reference(q_nope, q_pe, cache, seqlens, w_uk, w_uv, 0.2)
    assert max_abs_err(got, want) <= FP32_ATOL
