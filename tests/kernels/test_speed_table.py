"""``recover --attn-implementation auto`` (mha2mla/kernels/speed_table.py): the Triton MLA kernel only where a GPU
measurement shows it at least as fast as SDPA both ways, SDPA elsewhere, and what runs is logged."""

from __future__ import annotations

import logging

from mha2mla.kernels import speed_table
from mha2mla.kernels.speed_table import KernelSpeed, training_attention

SMOLLM2_MLA = {"model_type": "deepseek_v3", "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
FAST = KernelSpeed("H200", "bfloat16", 64, 32, 64, forward_speedup=1.1, backward_speedup=1.0)


def test_today_auto_is_sdpa_everywhere(caplog):
    """No GPU measurement shows the kernel at least as fast as SDPA yet: the shipped table holds no such row."""
    assert all(min(row.forward_speedup, row.backward_speedup) < 1.0 for row in speed_table.MEASURED)
    with caplog.at_level(logging.INFO, logger=speed_table.__name__):
        assert training_attention("cuda", "bfloat16", SMOLLM2_MLA, gpu_name="NVIDIA H200") == "sdpa"
        assert training_attention("cpu", "float32", SMOLLM2_MLA) == "sdpa"
    assert "no measurement of the Triton MLA kernel for d_n 64, d_r 32, d_v 64 in bfloat16 on NVIDIA H200" in caplog.text
    assert "CUDA only" in caplog.text


def test_a_measured_row_decides(caplog):
    table = (FAST, KernelSpeed("H100", "bfloat16", 64, 32, 64, forward_speedup=1.3, backward_speedup=0.8))
    with caplog.at_level(logging.INFO, logger=speed_table.__name__):
        assert training_attention("cuda", "bfloat16", SMOLLM2_MLA, "NVIDIA H200", table) == "mha2mla_triton"
        assert training_attention("cuda", "bfloat16", SMOLLM2_MLA, "NVIDIA H100 80GB HBM3", table) == "sdpa"
    assert "at least as fast as SDPA" in caplog.text and "slower than SDPA" in caplog.text
    assert training_attention("cuda", "float32", SMOLLM2_MLA, "NVIDIA H200", table) == "sdpa"  # other dtype
    other_dims = {**SMOLLM2_MLA, "qk_rope_head_dim": 16}
    assert training_attention("cuda", "bfloat16", other_dims, "NVIDIA H200", table) == "sdpa"
    assert training_attention("cpu", "bfloat16", SMOLLM2_MLA, "NVIDIA H200", table) == "sdpa"  # never off CUDA


def test_recover_resolves_auto_through_the_table(monkeypatch):
    """recover's loader: ``auto`` goes through the table with the run's device, compute dtype and head dims."""
    from mha2mla.train import model as train_model

    assert train_model.resolve_attn_implementation("auto", "cpu", "float32", SMOLLM2_MLA) == "sdpa"
    asked = []
    monkeypatch.setattr(speed_table, "training_attention", lambda *a: asked.append(a) or "mha2mla_triton")
    assert train_model.resolve_attn_implementation("auto", "cuda", "bfloat16", SMOLLM2_MLA) == "mha2mla_triton"
    assert asked == [("cuda", "bfloat16", SMOLLM2_MLA)]
    assert train_model.resolve_attn_implementation("sdpa", "cuda", "bfloat16", SMOLLM2_MLA) == "sdpa"
    assert len(asked) == 1  # only auto asks the table
