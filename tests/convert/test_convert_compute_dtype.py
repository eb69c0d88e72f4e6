"""The conversion's compute dtype (mha2mla/compute.py): decided once in the plan, bf16 where the CPU multiplies it
natively; the layer forwards and the reconstruction run in it, the statistics and the residual stream stay float32,
and float32 — the exact setting, whose exactness tests/convert/test_calibration.py proves — stays what it was."""

from __future__ import annotations

import pytest
import torch
from common import build_source, logits
from pydantic import ValidationError

from mha2mla import compute
from mha2mla.convert.calibration.stream import CalibrationStream
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert
from mha2mla.convert.plan.resolve import make_plan
from mha2mla.convert.source_reader import SourceReader
from mha2mla.families import family_for_config
from mha2mla.io.source import open_source

HEAD_DIM = 16


def plan_for(folder, **options):
    ckpt = open_source(folder)
    return make_plan(ckpt.config, family_for_config(ckpt.config), ConvertConfig(**options))


def test_auto_is_bf16_only_where_the_cpu_reports_it(llama_source, monkeypatch):
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx2", "fma"})
    assert plan_for(llama_source, calib_device="cpu").compute_dtype == "float32"
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    plan = plan_for(llama_source, calib_device="cpu")
    assert plan.compute_dtype == "bfloat16" and "computed in bfloat16" in plan.method_summary()
    assert plan_for(llama_source, calib_device="cpu", compute_dtype="float32").compute_dtype == "float32"
    assert plan_for(llama_source, calib=None).compute_dtype == "float32"  # the weight-only path computes nothing


def test_weight_only_refuses_a_compute_dtype():
    with pytest.raises(ValidationError, match="compute_dtype"):
        ConvertConfig(calib="none", compute_dtype="bfloat16")


def test_the_stream_computes_in_bf16_and_keeps_float32_residuals(llama_source):
    ckpt = open_source(llama_source)
    family = family_for_config(ckpt.config)
    plan = make_plan(ckpt.config, family, ConvertConfig(profile="exact", kv_budget=0.5, compute_dtype="bfloat16"))
    tokens = torch.randint(0, 384, (3, 24), generator=torch.Generator().manual_seed(3))
    stream = CalibrationStream(SourceReader(ckpt, family, plan), tokens, device="cpu")
    activations = stream.enter(0)
    assert {p.dtype for p in activations.source.parameters()} == {torch.bfloat16}
    assert stream.source_rope[0].dtype == torch.bfloat16 and stream.causal_mask.dtype == torch.bfloat16
    before = stream.hidden.clone()
    stream.advance(activations, None)
    assert stream.hidden.dtype == torch.float32 and not torch.equal(stream.hidden, before)


def test_bf16_statistics_are_near_the_float32_ones(llama_source):
    """A bf16 stream's per-head moments (its layer forward, hence the probabilities and the normed inputs, and
    each batch's products in bf16, summed in float32) stay within two percent of the float32 stream's (float32 is
    the exact path, whose moments tests/convert/test_calibration.py checks against a direct computation)."""
    from mha2mla.convert.calibration.measure import measure

    ckpt = open_source(llama_source)
    family = family_for_config(ckpt.config)
    tokens = torch.randint(0, 384, (16, 48), generator=torch.Generator().manual_seed(5))
    stats = {}
    for dtype in ("float32", "bfloat16"):
        plan = make_plan(ckpt.config, family, ConvertConfig(profile="exact", kv_budget=0.5, compute_dtype=dtype))
        stream = CalibrationStream(SourceReader(ckpt, family, plan), tokens, device="cpu")
        stats[dtype] = measure(stream.enter(0))
    for name in ("value_covariances", "key_covariances"):
        exact, bf16 = getattr(stats["float32"], name), getattr(stats["bfloat16"], name)
        assert bf16.dtype == torch.float32
        relative = ((bf16 - exact).norm() / exact.norm()).item()
        assert 0 < relative < 2e-2, (name, relative)  # rounded, and only slightly


def convert_with(folder, out, compute_dtype, **options):
    calib = out.parent / "calib.txt"  # random letters: held-out windows like the fitted ones
    if not calib.exists():
        letters = torch.randint(0, 31, (60_000,), generator=torch.Generator().manual_seed(8))
        calib.write_text("".join("abcdefghijklmnopqrstuvwxyz     "[i] for i in letters))
    options = ConvertConfig(profile="exact", compute_dtype=compute_dtype, calib=str(calib), calib_samples=32,
                            calib_seq_len=64, **options)
    return convert(folder, out, options, progress=False)


def test_bf16_reconstruction_lowers_the_error_with_float32_masters(llama_source, tmp_path):
    """At a low rank, the bf16 conversion's reconstruction still lowers every layer's held-out error, and its
    errors and logits stay near the float32 conversion's."""
    results = {dtype: convert_with(llama_source, tmp_path / dtype, dtype, kv_lora_rank=9, rope_dim=HEAD_DIM // 2)
               for dtype in ("float32", "bfloat16")}
    layers = results["bfloat16"].report.layers
    assert all(layer["reconstruction_error_after"] < layer["reconstruction_error"] for layer in layers), [
        (layer["reconstruction_error"], layer["reconstruction_error_after"]) for layer in layers]
    for ours, exact in zip(layers, results["float32"].report.layers):
        assert ours["reconstruction_error_after"] == pytest.approx(exact["reconstruction_error_after"], rel=0.1)
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))
    fp32, bf16 = (logits(tmp_path / d, ids) for d in ("float32", "bfloat16"))
    # bf16 statistics (products in bf16) move this random, flat-spectrum toy's rank-9 latent more than a real
    # model's, whose held-out perplexity they leave as it was (docs/benchmarks.md, "conversion cost")
    assert (fp32 - bf16).abs().max() < 0.12 * fp32.abs().max()


def test_bf16_full_capacity_is_close_and_float32_exact(tmp_path):
    """Full capacity (MQA: one key head, all its pairs rope): float32 reproduces the source's logits (the exact
    setting); bf16 computes the same conversion to within bf16 rounding."""
    source_folder = build_source(tmp_path / "mqa", "llama", num_heads=4, num_kv_heads=1)
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))
    source = logits(source_folder, ids)
    full = dict(kv_lora_rank=2 * HEAD_DIM + 1, rope_dim=HEAD_DIM)
    for dtype, tolerance in (("float32", 1e-4), ("bfloat16", 2e-2)):
        convert_with(source_folder, tmp_path / dtype, dtype, **full)
        converted = logits(tmp_path / dtype, ids)
        assert (converted - source).abs().max() < tolerance * source.abs().max(), dtype
