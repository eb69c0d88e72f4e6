"""Calibration-aware conversion: statistics collection, text loading, and the exactness of every method."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from common import build_source, logits
from transformers import AutoModelForCausalLM, AutoTokenizer

from mha2mla import UserError
from mha2mla.convert import pipeline
from mha2mla.convert.calibration import measure as measure_module
from mha2mla.convert.calibration.data import calibration_documents, calibration_token_ids
from mha2mla.convert.calibration.measure import measure
from mha2mla.convert.calibration.stream import CalibrationStream
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert
from mha2mla.convert.plan import resolve
from mha2mla.convert.plan.methods import Methods, product_methods
from mha2mla.convert.plan.resolve import make_plan
from mha2mla.convert.source_reader import SourceReader
from mha2mla.convert.steps.lowrank import joint_low_rank
from mha2mla.convert.steps.norm import stabilized_norm, unit_rms_norm
from mha2mla.convert.steps.records import LayerStatistics, LayerWork, SourceAttention
from mha2mla.convert.steps.rope import mean_compensation
from mha2mla.families import family_for_config
from mha2mla.io.source import open_source

HEAD_DIM = 16
HIDDEN = 64


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib_sources")
    return {
        "llama_mqa": build_source(root / "llama_mqa", "llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
        "qwen2_mqa": build_source(root / "qwen2_mqa", "qwen2", num_heads=4, num_kv_heads=1),
        "llama_gqa": build_source(root / "llama_gqa", "llama", num_heads=4, num_kv_heads=2),
    }


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))


def direct_statistics(folder, tokens, layer):
    """E[x xᵀ] and E[x] of layer ``layer``'s attention input, from the source model run whole."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states[layer]  # (N, L, D)
        x = model.model.layers[layer].input_layernorm(hidden).reshape(-1, hidden.shape[-1]).double()
    return x.T @ x / x.shape[0], x.mean(0)


def calibrated(profile="exact", sequential=True, **changes) -> Methods:
    return dataclasses.replace(product_methods(profile, calibrated=True), sequential=sequential, **changes)


@contextmanager
def methods_in_plan(methods: Methods):
    """Plans made inside resolve to ``methods`` on the calibrated path instead of the product's set: the
    ablations' exactness is tested without a product parameter for them."""
    product = resolve.product_methods
    with mock.patch.object(resolve, "product_methods", lambda profile, calibrated, reconstruct=True:
                           methods if calibrated else product(profile, calibrated, reconstruct)):
        yield


def default_tokens(folder, samples: int, seq_len: int, calib: str = "default") -> torch.Tensor:
    """(samples, seq_len): the token ids a conversion of ``folder`` with ``calib`` calibrates on."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return calibration_token_ids(calibration_documents(calib), tokenizer, samples, seq_len)


def random_text(path, seed: int, characters: int = 60_000) -> str:
    """A calibration text file of random letters and spaces: its windows are alike, so a held-out window behaves like
    the ones fitted on (the bundled sample ends in code the rest does not resemble)."""
    generator = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    path.write_text("".join(alphabet[i] for i in torch.randint(0, len(alphabet), (characters,), generator=generator)))
    return str(path)


def stream_for(folder, tokens, sequential, profile="exact", **options) -> CalibrationStream:
    ckpt = open_source(folder)
    family = family_for_config(ckpt.config)
    options.setdefault("compute_dtype", "float32")  # statistics compared with float32 computations
    with methods_in_plan(calibrated(profile, sequential)):
        plan = make_plan(ckpt.config, family, ConvertConfig(profile=profile, **options))
    return CalibrationStream(SourceReader(ckpt, family, plan), tokens, device="cpu")


def statistics_at(stream: CalibrationStream, layer: int) -> LayerStatistics:
    """The statistics of ``layer``, the stream carried through the source layers before it."""
    for before in range(layer):
        stream.advance(stream.enter(before), None)
    return measure(stream.enter(layer))


# --- statistics collection ------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [0, 1])
def test_statistics_equal_a_direct_computation(sources, layer):
    tokens = torch.randint(0, 384, (3, 24), generator=torch.Generator().manual_seed(2))
    stats = statistics_at(stream_for(sources["llama_gqa"], tokens, sequential=False, kv_budget=0.5), layer)
    covariance, mean = direct_statistics(sources["llama_gqa"], tokens, layer)
    assert stats.num_tokens == 3 * 24
    torch.testing.assert_close(stats.input_covariance, covariance, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.input_mean, mean, rtol=1e-5, atol=1e-6)
    assert stats.input_sample.shape == (3 * 24, HIDDEN)


def direct_attention_statistics(folder, tokens, layer, query_stride, key_stride, key_dense, key_power):
    """Per query head: E[x̄ x̄ᵀ], the attention-received-weighted E[x xᵀ] and the distance histogram,
    from the source model run whole with eager attention (its returned probabilities)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, output_attentions=True)
        x = model.model.layers[layer].input_layernorm(out.hidden_states[layer]).double()  # (N, L, D)
        p = out.attentions[layer].double()  # (N, H, L, L)
    N, H, L, _ = p.shape
    averaged = p[:, :, ::query_stride] @ x[:, None]  # (N, H, L/s, D)
    values = torch.einsum("nhqd,nhqe->hde", averaged, averaged) / (N * averaged.shape[2])
    keys = list(range(min(key_dense, L))) + list(range(key_dense, L, key_stride))  # dense start, then strided
    share = torch.tensor([1.0 if j < key_dense else float(key_stride) for j in keys], dtype=torch.float64)
    weight = p.sum(2)[:, :, keys] ** key_power * share  # (N, H, k)
    xs = x[:, keys]
    keys = torch.einsum("nhk,nkd,nke->hde", weight, xs, xs) / weight.sum((0, 2))[:, None, None]
    histogram = torch.zeros(H, L, dtype=torch.float64)
    for i in range(L):
        for j in range(i + 1):
            histogram[:, i - j] += p[:, :, i, j].sum(0)
    return values, keys, histogram / histogram.sum(-1, keepdim=True)


@pytest.mark.parametrize("name, layer", [("llama_gqa", 0), ("llama_gqa", 1), ("llama_mqa", 1)])
def test_attention_statistics_equal_a_direct_computation(sources, name, layer, monkeypatch):
    """Here the dense moments pass the (lowered) limit. GQA has 2·G·d = D: moments in input coordinates. MQA's
    K/V rows span 32 of 64 dims: the moments are measured in the coordinates of an orthonormal basis of them."""
    monkeypatch.setattr(measure_module, "DENSE_MOMENTS_LIMIT", 0)
    tokens = torch.randint(0, 384, (3, 24), generator=torch.Generator().manual_seed(5))
    stats = statistics_at(stream_for(sources[name], tokens, sequential=False, kv_budget=0.5), layer)
    values, keys, histogram = direct_attention_statistics(
        sources[name], tokens, layer, measure_module.QUERY_STRIDE, measure_module.KEY_STRIDE, measure_module.KEY_DENSE,
        measure_module.KEY_WEIGHT_POWER)
    basis = stats.moment_basis
    if name == "llama_gqa":
        assert basis is None
    else:
        weights = {k: v.double() for k, v in AutoModelForCausalLM.from_pretrained(sources[name]).state_dict().items()}
        rows = torch.cat([weights[f"model.layers.{layer}.self_attn.{p}_proj.weight"] for p in "kv"])  # (32, D)
        assert basis.shape == (32, HIDDEN)
        torch.testing.assert_close(basis.double() @ basis.double().T, torch.eye(32, dtype=torch.float64), atol=1e-10, rtol=0)
        torch.testing.assert_close(rows @ basis.double().T @ basis.double(), rows, atol=1e-10, rtol=0)  # spans the rows
        values, keys = (basis.double() @ moment @ basis.double().T for moment in (values, keys))
    side = HIDDEN if basis is None else basis.shape[0]
    assert stats.value_covariances.shape == (4, side, side)
    torch.testing.assert_close(stats.value_covariances.double(), values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.key_covariances.double(), keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.distance_histogram, histogram, rtol=1e-4, atol=1e-6)
    config = json.loads((sources[name] / "config.json").read_text())
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 10000.0))
    expected = theta ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(stats.pair_frequencies, expected, rtol=1e-6, atol=0)


def test_sequential_statistics_follow_the_converted_layer(sources, monkeypatch):
    """Layer 1's statistics come from the converted layer 0: equal to the source's when that layer is
    exact (MQA, full capacity), different when it is cut to a low rank."""
    folder = sources["llama_mqa"]
    tokens = default_tokens(folder, 2, 24)
    covariance, _ = direct_statistics(folder, tokens, 1)
    seen = {}

    def recording(activations):
        seen[activations.layer] = measure(activations)
        return seen[activations.layer]

    monkeypatch.setattr(pipeline, "measure", recording)
    for rank, should_match in ((2 * HEAD_DIM + 1, True), (4, False)):
        out = folder.parent / f"seq_rank{rank}"
        options = ConvertConfig(profile="exact", kv_lora_rank=rank, rope_dim=HEAD_DIM, compute_dtype="float32",
                                calib_samples=2, calib_seq_len=24)
        convert(folder, out, options, progress=False, force=True)
        close = torch.allclose(seen[1].input_covariance, covariance, rtol=1e-4, atol=1e-4)
        assert close == should_match, (rank, (seen[1].input_covariance - covariance).abs().max())


def test_refit_errors_equal_a_direct_computation(sources, tmp_path):
    """The refit's reported errors of layer 0 (the same input in both streams) equal the errors of the
    written checkpoint measured directly: its heads' outputs against the source heads' (eager attention)
    before o_proj, and its attention output against the source's after it."""
    folder = sources["llama_gqa"]
    tokens = default_tokens(folder, 4, 24)
    options = ConvertConfig(profile="exact", kv_lora_rank=9, rope_dim=HEAD_DIM // 2, reconstruct=False,
                            calib_samples=4, calib_seq_len=24)
    result = convert(folder, tmp_path / "out", options, progress=False)
    # the default (reconstruction off: the refit's own output)
    assert result.plan.methods.refit == "ridge" and result.plan.methods.sequential
    report = result.report.layers[0]
    assert report["v_output_error_refit"] < report["v_output_error"]  # it validated, and helped

    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
    heads = {}
    target.model.layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, output: heads.update(z=args[0], y=output))
    with torch.no_grad():
        p_source = source(tokens, output_attentions=True).attentions[0]  # (N, H, L, L)
        target(tokens)
        layer = source.model.layers[0]
        x = layer.input_layernorm(source.model.embed_tokens(tokens))
        v = layer.self_attn.v_proj(x).view(*tokens.shape, 2, HEAD_DIM).transpose(1, 2).repeat_interleave(2, dim=1)
        t = (p_source @ v).transpose(1, 2).reshape(*tokens.shape, -1)  # (N, L, H*d)
        y = layer.self_attn.o_proj(t)
    o_bias = target.model.layers[0].self_attn.o_proj.bias
    v_error = ((heads["z"] - t).pow(2).sum() / t.pow(2).sum()).sqrt().item()
    o_error = ((heads["y"] - o_bias - y).pow(2).sum() / y.pow(2).sum()).sqrt().item()
    assert abs(v_error - report["v_output_error_refit"]) < 2e-3, (v_error, report)
    assert abs(o_error - report["o_output_error_refit"]) < 2e-3, (o_error, report)


def test_the_stream_goes_through_the_layers_in_order(sources):
    """The pipeline drives the stream: a layer is entered only when the stream has advanced to it."""
    tokens = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(4))
    stream = stream_for(sources["llama_gqa"], tokens, sequential=False, kv_budget=0.5)
    with pytest.raises(RuntimeError, match="at layer 0, not 1"):
        stream.enter(1)
    activations = stream.enter(0)
    stream.advance(activations, None)
    with pytest.raises(RuntimeError, match="at layer 1, not 0"):
        stream.advance(activations, None)
    assert stream.enter(1).layer == 1


def test_the_stream_advances_causally_through_the_converted_attention(sources):
    """At full capacity (exact profile, an MQA source) the converted attention is the source's, so the stream
    advanced through it (on the CPU the eager softmax with the explicit causal mask) equals the second stream,
    advanced through the source attention; an attention that saw later tokens would not."""
    from mha2mla.convert.pipeline import _convert_layer

    tokens = torch.randint(0, 384, (4, 24), generator=torch.Generator().manual_seed(5))
    stream = stream_for(sources["llama_mqa"], tokens, sequential=True, kv_lora_rank=2 * HEAD_DIM + 1, rope_dim=HEAD_DIM)
    assert stream.source_hidden is not None and stream.device.type == "cpu"
    before = stream.hidden.clone()
    _convert_layer(stream.reader, 0, stream)
    assert (stream.hidden - before).abs().max() > 1e-2  # the layer did move the stream
    torch.testing.assert_close(stream.hidden, stream.source_hidden, rtol=1e-4, atol=1e-4)


# --- every method keeps full-capacity conversions exact (docs/design.md §3 ladder, rung a) ----------

METHOD_GRID = {  # the product's calibrated set, with and without the sequential stream and the refit
    "default": calibrated(),
    "default-source-stream": calibrated(sequential=False),
    "no-refit": calibrated(refit="none"),
}


@pytest.mark.parametrize("name", ["llama_mqa", "qwen2_mqa"])
@pytest.mark.parametrize("label", list(METHOD_GRID))
def test_every_method_is_exact_at_full_capacity(sources, input_ids, tmp_path, name, label):
    methods = METHOD_GRID[label]
    options = ConvertConfig(profile="exact", kv_lora_rank=2 * HEAD_DIM + 1, rope_dim=HEAD_DIM, calib="default", compute_dtype="float32",
                             calib_samples=4, calib_seq_len=32)
    with methods_in_plan(methods):
        result = convert(sources[name], tmp_path / "out", options, progress=False)
    assert result.report.methods == methods.to_dict() and result.plan.calibrated
    difference = (logits(tmp_path / "out", input_ids) - logits(sources[name], input_ids)).abs().max().item()
    assert difference < 1e-4, difference
    if methods.refit != "none":  # the refit ran, and found the exact heads and o_proj exact
        # (moment-based errors: float32 products, so ~1e-4 is zero here; a low-rank SmolLM2 layer is ~0.3)
        errors = ["v_output_error", "v_output_error_refit", "o_output_error", "o_output_error_refit"]
        assert all(layer[key] < 1e-3 for layer in result.report.layers for key in errors)


@pytest.mark.parametrize("name", ["llama_mqa", "qwen2_mqa"])
def test_weight_only_is_exact_at_full_capacity(sources, input_ids, tmp_path, name):
    options = ConvertConfig(profile="exact", kv_lora_rank=2 * HEAD_DIM + 1, rope_dim=HEAD_DIM, calib="none")
    result = convert(sources[name], tmp_path / "out", options, progress=False)
    assert not result.plan.calibrated and result.report.methods["lowrank"] == "svd"
    difference = (logits(tmp_path / "out", input_ids) - logits(sources[name], input_ids)).abs().max().item()
    assert difference < 1e-4, difference


@pytest.mark.parametrize("norm", ["rms", "stabilized"])
def test_portable_norm_calibrations_write_valid_outputs_and_differ(sources, input_ids, tmp_path, norm):
    options = ConvertConfig(profile="portable", kv_budget=0.5, calib="default", calib_samples=4, calib_seq_len=32)
    # no fit step after the norm: reconstruction may move a portable kv_a_layernorm weight (the step's own output is tested)
    with methods_in_plan(calibrated("portable", kv_norm=norm, reconstruct="none")):
        convert(sources["llama_gqa"], tmp_path / "out", options, progress=False)
    from safetensors.torch import load_file

    weights = load_file(str(next((tmp_path / "out").glob("model*.safetensors"))))
    norm_weight = weights["model.layers.0.self_attn.kv_a_layernorm.weight"]
    if norm == "rms":
        assert torch.all(norm_weight == 1)
    else:
        assert not torch.all(norm_weight == 1)
    assert torch.isfinite(logits(tmp_path / "out", input_ids)).all()


# --- the pieces -----------------------------------------------------------------------------------

def test_svd_and_pca_reproduce_full_rank_and_pca_fits_the_inputs_better():
    torch.manual_seed(0)
    G, d, D = 2, 8, 40
    key, value = torch.randn(G * d, D, dtype=torch.float64), torch.randn(G * d, D, dtype=torch.float64)
    x = torch.randn(500, D, dtype=torch.float64) * torch.linspace(0.1, 3, D, dtype=torch.float64)
    covariance = x.T @ x / 500
    stacked = torch.cat([key, value])
    for cov in (None, covariance):
        factors = joint_low_rank(key, value, 2 * G * d, cov)
        torch.testing.assert_close(factors.up @ factors.down, stacked, rtol=1e-8, atol=1e-8)

    def input_error(factors):  # E‖(M̂ - M) x‖² on the inputs
        error = factors.up @ factors.down - stacked
        return float(torch.einsum("ij,jk,ik->", error, covariance, error))

    assert input_error(joint_low_rank(key, value, 5, covariance)) < input_error(joint_low_rank(key, value, 5))


def test_mean_rotation_stands_in_for_the_dropped_rotation():
    """q' · k with q' from the mean rope compensation equals the histogram-weighted mean of the real
    rotated score q_m · k_n over distances m - n (transformers' own rotary), for every pair."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(4)
    H, d, L = 2, 8, 12
    frequencies = 1.0 / 100.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    histogram = torch.rand(H, L, dtype=torch.float64, generator=generator)
    q = torch.randn(H, d, dtype=torch.float64, generator=generator)
    k = torch.randn(H, d, dtype=torch.float64, generator=generator)
    stats = LayerStatistics(distance_histogram=histogram, pair_frequencies=frequencies)
    shape = SimpleNamespace(num_heads=H, num_kv_heads=H, head_dim=d)
    source = SourceAttention(q_weight=q.reshape(H * d, 1), k_weight=k.reshape(H * d, 1), v_weight=k.reshape(H * d, 1),
                             o_weight=torch.zeros(1, H * d), input_norm_weight=torch.ones(1))
    work = LayerWork(layer=0, plan=SimpleNamespace(shape=shape), source=source, stats=stats)
    mean_compensation(work)
    compensated = work.query.weight  # rows of a (H, d, 1) "weight"
    angles = torch.arange(L, dtype=torch.float64)[:, None] * frequencies[None]  # (L, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (L, d)
    for h in range(H):
        # query at position Δ, key at position 0
        q_rot, _ = apply_rotary_pos_emb(q[h].expand(L, d)[None, None], q[h].expand(L, d)[None, None], cos[None], sin[None])
        k_rot, _ = apply_rotary_pos_emb(k[h].expand(L, d)[None, None], k[h].expand(L, d)[None, None], cos[None], sin[None])
        scores = (q_rot[0, 0] * k_rot[0, 0, :1]).sum(-1)  # (L,): q_Δ · k_0
        expected = (histogram[h] / histogram[h].sum() * scores).sum()
        assert float(compensated[h, :, 0] @ k[h]) == pytest.approx(float(expected), rel=1e-10)


def test_attention_aware_low_rank_captures_more_and_is_exact_at_full_rank():
    from mha2mla.convert.steps.lowrank import attention_aware_low_rank

    generator = torch.Generator().manual_seed(6)
    G, H, d, D = 2, 4, 6, 40
    key = torch.randn(G, d, D, dtype=torch.float64, generator=generator)
    value = torch.randn(G, d, D, dtype=torch.float64, generator=generator)
    x = torch.randn(2000, D, dtype=torch.float64, generator=generator) * torch.linspace(0.2, 2, D, dtype=torch.float64)
    covariance = x.T @ x / 2000
    smooth = [torch.softmax(torch.randn(2000, 2000, dtype=torch.float64, generator=generator)[:200], -1) @ x for _ in range(H)]
    value_covariances = torch.stack([a.T @ a / 200 for a in smooth])  # (H, D, D): averaged inputs, differently per head
    up_k, up_v, down = attention_aware_low_rank(key, value, 2 * G * d, covariance, value_covariances)
    for h in range(H):  # full rank: exact for every head
        torch.testing.assert_close(up_k[h] @ down, key[h // 2], rtol=1e-7, atol=1e-7)
        torch.testing.assert_close(up_v[h] @ down, value[h // 2], rtol=1e-7, atol=1e-7)

    def relative_error(up_k, up_v, down):  # K on single tokens, V on each head's own averaged inputs
        def error(up, rows, covariances):
            errors = up @ down - rows.repeat_interleave(2, 0)  # (H, d, D)
            return sum(float(torch.einsum("ij,jk,ik->", e, c, e)) / float(torch.einsum("ij,jk,ik->", t, c, t))
                       for e, t, c in zip(errors, rows.repeat_interleave(2, 0), covariances))
        return error(up_k, key, covariance.expand(H, D, D)) + error(up_v, value, value_covariances)

    pca = joint_low_rank(key.reshape(-1, D), value.reshape(-1, D), 5, covariance)
    pca_up = pca.up.view(2, G, d, -1).repeat_interleave(2, 1)  # (K|V, H, d, r)
    assert relative_error(*attention_aware_low_rank(key, value, 5, covariance, value_covariances)) \
        < relative_error(pca_up[0], pca_up[1], pca.down)


def test_unit_rms_norm_matches_its_definition():
    torch.manual_seed(3)
    down = torch.randn(6, 16, dtype=torch.float64)
    sample = torch.randn(300, 16, dtype=torch.float64) * torch.rand(300, 1, dtype=torch.float64)
    covariance = sample.T @ sample / 300
    norm = unit_rms_norm(down, covariance)
    assert norm.latent_scale == pytest.approx(float((sample @ down.T).pow(2).mean().sqrt()), rel=1e-9)
    assert torch.all(norm.weight == 1) and norm.stabilizer is None
    scale = torch.linspace(0.5, 2, 16, dtype=torch.float64)  # weight-only: inputs = the input norm's weight × unit noise
    assert unit_rms_norm(down, None, scale).latent_scale == pytest.approx(float(((down * scale) ** 2).sum() / 6) ** 0.5)


# --- calibration text ------------------------------------------------------------------------------

def test_calibration_text_sources(tmp_path):
    """`default` is the bundled sample; anything else goes through the one document reader."""
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "first"}) + "\n" + json.dumps({"content": "second"}) + "\n")
    assert list(calibration_documents(str(tmp_path / "a.txt"))) == ["plain text file"]
    assert sorted(calibration_documents(str(tmp_path))) == ["first", "plain text file", "second"]
    assert len(list(calibration_documents("default"))[0]) > 100_000  # the bundled sample
    with pytest.raises(UserError):
        list(calibration_documents(str(tmp_path / "missing.txt")))


def test_calibration_windows_are_evenly_spread(sources):
    tokenizer = AutoTokenizer.from_pretrained(str(sources["llama_gqa"]))
    tokens = calibration_token_ids(["the keys were gathered into a latent " * 200], tokenizer, 5, 16)
    assert tokens.shape == (5, 16)
    assert len({tuple(row.tolist()) for row in tokens}) > 1
    with pytest.raises(UserError):
        calibration_token_ids(["tiny"], tokenizer, 2, 1000)


# --- the portable profile's stabiliser channel ------------------------------------------------------

def test_stabiliser_channel_keeps_sink_like_tokens_from_being_blown_up():
    """Tokens whose input lies mostly outside the latent's row space (as attention sinks do in deep
    layers) get a small latent that a plain norm would inflate; the stabiliser channel fixes that."""
    generator = torch.Generator().manual_seed(0)
    D, r = 32, 8
    down = torch.linalg.qr(torch.randn(D, r, dtype=torch.float64, generator=generator))[0].T  # (r, D)
    normal = torch.randn(2000, D, dtype=torch.float64, generator=generator)
    sink_direction = torch.randn(D, dtype=torch.float64, generator=generator)
    sink_direction -= down.T @ (down @ sink_direction)  # orthogonal to the latent's rows
    sink_direction *= 12 / sink_direction.norm()
    sinks = 0.1 * torch.randn(40, D, dtype=torch.float64, generator=generator) + sink_direction
    sample = torch.cat([normal, sinks])
    cov = sample.T @ sample / sample.shape[0]

    def relative_error(norm, x):
        latent = x @ down.T / norm.latent_scale  # (n, r)
        channels = [latent] if norm.stabilizer is None else [latent, x @ norm.stabilizer.T]
        full = torch.cat(channels, dim=-1)
        rms = full.pow(2).mean(-1, keepdim=True).sqrt()
        output = (norm.weight * full / rms)[:, :r]
        return ((output - latent).pow(2).sum(-1) / latent.pow(2).sum(-1)).mean().item()

    plain = unit_rms_norm(down, cov)
    stabilised = stabilized_norm(down, cov, sample, channels=1)
    assert stabilised.stabilizer.shape == (1, D) and stabilised.weight.shape == (r + 1,)
    assert relative_error(plain, sinks) > 10
    assert relative_error(stabilised, sinks) < 0.1 * relative_error(plain, sinks)
    assert relative_error(stabilised, normal) < 1.5 * relative_error(plain, normal) + 0.01


def test_calibrated_portable_output_spends_one_cache_value_on_the_stabiliser(sources, input_ids, tmp_path):
    from safetensors.torch import load_file

    from mha2mla.convert.output.portable import check_portable_folder

    options = ConvertConfig(profile="portable", kv_lora_rank=13, rope_dim=8, calib="default", calib_samples=4,
                             calib_seq_len=32)
    result = convert(sources["llama_gqa"], tmp_path / "out", options, progress=False)
    assert result.plan.methods.kv_norm == "stabilized" and result.plan.extra_channels == 1 and result.plan.latent_rank == 12
    assert result.report.layers[0]["kv_lora_rank"] == 13
    assert check_portable_folder(tmp_path / "out") == []
    weights = load_file(str(next((tmp_path / "out").glob("model*.safetensors"))))
    kv_b = weights["model.layers.0.self_attn.kv_b_proj.weight"]  # (H*(d_n+d_v), 13)
    assert torch.all(kv_b[:, -1] == 0) and kv_b[:, :-1].abs().sum() > 0  # K/V never read the stabiliser
    assert weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][12].abs().sum() > 0
    assert torch.isfinite(logits(tmp_path / "out", input_ids)).all()


# --- layer-wise reconstruction (part of the calibrated default: convert/steps/reconstruct.py) ----

@pytest.mark.parametrize("name", ["llama_mqa", "qwen2_mqa"])
def test_reconstruction_keeps_full_capacity_exact(sources, input_ids, tmp_path, name):
    options = ConvertConfig(profile="exact", kv_lora_rank=2 * HEAD_DIM + 1, rope_dim=HEAD_DIM, calib_samples=8, calib_seq_len=32,
                             compute_dtype="float32")
    result = convert(sources[name], tmp_path / "out", options, progress=False)  # the default: reconstruction included
    assert result.plan.methods.reconstruct == "gradient"
    difference = (logits(tmp_path / "out", input_ids) - logits(sources[name], input_ids)).abs().max().item()
    assert difference < 1e-4, difference
    assert all(layer["reconstruction_error_after"] <= layer["reconstruction_error"] for layer in result.report.layers)


def test_reconstruction_lowers_the_held_out_error_and_reports_it_truly(sources, tmp_path):
    """At low rank each layer's held-out reconstruction error falls (early stopping keeps the best point, so
    it never rises), and the reported errors equal a direct computation on the written checkpoint: layer 0's
    target is the source attention output, layer 1's also carries the residual drift layer 0 left."""
    from mha2mla.convert.steps import reconstruct as module

    folder = sources["llama_gqa"]
    calib = random_text(tmp_path / "calib.txt", seed=8)
    tokens = default_tokens(folder, 32, 64, calib)
    options = ConvertConfig(profile="exact", kv_lora_rank=9, rope_dim=HEAD_DIM // 2, compute_dtype="float32",
                            calib=calib, calib_samples=32, calib_seq_len=64)
    result = convert(folder, tmp_path / "out", options, progress=False)
    layers = result.report.layers
    assert all(layer["reconstruction_error_after"] < layer["reconstruction_error"] for layer in layers), [
        (layer["reconstruction_error"], layer["reconstruction_error_after"]) for layer in layers]
    assert layers[0]["reconstruction_error_after"] < 0.99 * layers[0]["reconstruction_error"]
    # no massive activations in this model (the next test has them): the drift below is every token's
    assert [layer["reconstruction_massive_tokens"] for layer in layers] == [0] * len(layers)
    # the held-out sequences are the last ones; layer 0 sees the embeddings in both streams
    held = tokens[-max(1, round(len(tokens) * module.HELD_OUT_FRACTION)):]
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    inputs, outputs = {}, {}
    for name, model in (("source", source), ("target", target)):
        for i in (0, 1):
            layer = model.model.layers[i]
            layer.register_forward_pre_hook(
                lambda m, args, kwargs, key=(name, i): inputs.update({key: args[0] if args else kwargs["hidden_states"]}),
                with_kwargs=True)
            layer.self_attn.register_forward_hook(lambda m, a, out, key=(name, i): outputs.update({key: out[0]}))
        with torch.no_grad():
            model(held)
    for i in (0, 1):
        drift = inputs[("source", i)] - inputs[("target", i)]
        assert (drift.abs().max() > 1e-3) == (i == 1)  # layer 0 converted and low rank: layer 1's streams differ
        wanted = outputs[("source", i)] + drift
        error = ((outputs[("target", i)] - wanted).pow(2).sum() / wanted.pow(2).sum()).sqrt().item()
        assert abs(error - layers[i]["reconstruction_error_after"]) < 1e-4, (i, error, layers[i])
    plain = ((outputs[("target", 1)] - outputs[("source", 1)]).pow(2).sum() / outputs[("source", 1)].pow(2).sum()).sqrt().item()
    assert abs(plain - layers[1]["reconstruction_error_after"]) > 1e-2  # the drift is really in layer 1's target


def test_reconstruction_target_leaves_out_the_drift_of_massive_activations(sources, monkeypatch):
    """The target is the source attention output plus the drift h_source − h_converted, except at tokens whose
    source residual norm passes MASSIVE_NORM_RATIO × the median (attention sinks): there the source attention
    output alone. Checked on the targets handed to the reconstruction loop."""
    from mha2mla.convert.steps import reconstruct as reconstruct_module
    from mha2mla.convert.steps.attention import assemble, run_steps
    from mha2mla.convert.steps.reconstruct import MASSIVE_NORM_RATIO, gradient_reconstruction
    from mha2mla.convert.steps.registry import LATENT_KINDS

    tokens = torch.randint(0, 384, (8, 32), generator=torch.Generator().manual_seed(13))
    stream = stream_for(sources["llama_gqa"], tokens, sequential=True, kv_budget=0.5)
    activations = stream.enter(0)
    stats = measure(activations)
    work = LayerWork(layer=0, plan=stream.plan, source=stream.reader.attention(0, stats), stats=stats, activations=activations)
    run_steps(work, LATENT_KINDS)
    assemble(work)
    generator = torch.Generator().manual_seed(14)
    stream.source_hidden.add_(0.3 * stream.hidden.std() * torch.randn(stream.hidden.shape, generator=generator))  # drift everywhere
    stream.source_hidden[:, 0] *= 2 * MASSIVE_NORM_RATIO  # every sequence's first token: a massive activation
    stream.source_hidden[3, 5] *= 0.8 * MASSIVE_NORM_RATIO  # large, but under the ratio: its drift stays
    captured = {}
    monkeypatch.setattr(reconstruct_module, "reconstruct", lambda module, data, exact, compute_dtype: captured.update(y=data.y.clone()) or {})
    gradient_reconstruction(work)
    assert work.report["reconstruction_massive_tokens"] == len(tokens)
    layer = activations.source
    with torch.no_grad():
        attention = activations.residual_scale * layer.self_attn(layer.input_layernorm(stream.source_hidden),
                                                                 position_embeddings=stream.source_rope, attention_mask=None)[0]
    drift = stream.source_hidden - stream.hidden
    torch.testing.assert_close(captured["y"][:, 0], attention[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(captured["y"][:, 1:], attention[:, 1:] + drift[:, 1:], rtol=1e-5, atol=1e-5)
    assert drift[:, 0].norm() > attention[:, 0].norm()  # leaving it out made a real difference


@pytest.mark.parametrize("weighted", [False, True])
def test_more_rows_than_inputs_factor_like_the_rows_by_rows_problem(weighted):
    """MHA stacks 2·H·d > D rows: the factorisation comes from the D × D problem; the subspace (hence
    up @ down) equals the top eigenvectors of the rows × rows moment, and full rank stays exact."""
    generator = torch.Generator().manual_seed(11)
    D, n = 24, 20  # 40 stacked rows over 24 inputs
    key = torch.randn(n, D, dtype=torch.float64, generator=generator)
    value = torch.randn(n, D, dtype=torch.float64, generator=generator) * 0.5
    x = torch.randn(500, D, dtype=torch.float64, generator=generator) * torch.linspace(0.3, 2, D, dtype=torch.float64)
    cov = x.T @ x / 500 if weighted else None
    factors = joint_low_rank(key, value, 7, cov)
    sigma = cov if weighted else torch.eye(D, dtype=torch.float64)
    balance = (torch.einsum("ij,jk,ik->", value, sigma, value) / torch.einsum("ij,jk,ik->", key, sigma, key)).sqrt()
    stacked = torch.cat([key * balance, value])  # the K rows weighed like the V rows, as joint_low_rank does
    top = torch.linalg.eigh(stacked @ sigma @ stacked.T)[1][:, -7:]  # the rows × rows problem, directly
    torch.testing.assert_close(factors.up[n:] @ factors.down, (top @ top.T @ stacked)[n:], rtol=1e-8, atol=1e-8)
    full = joint_low_rank(key, value, 2 * n, cov)
    torch.testing.assert_close(full.up @ full.down, torch.cat([key, value]), rtol=1e-8, atol=1e-8)


def test_ridge_refit_equals_the_direct_cross_validation():
    """The refit scores every ridge in the eigenbasis of each fold (O(n²) per ridge): the same choice, map and
    errors as fitting every ridge explicitly and measuring it on the other fold."""
    from mha2mla.convert.steps.refit import REFIT_RIDGES, ridge_refit

    generator = torch.Generator().manual_seed(12)
    B, m, n = 4, 24, 30
    features = [torch.randn(B, 120, n, dtype=torch.float64, generator=generator) for _ in range(2)]
    true = torch.randn(B, m, n, dtype=torch.float64, generator=generator)
    targets = [true @ f.transpose(1, 2) + 2.0 * torch.randn(B, m, 120, dtype=torch.float64, generator=generator) for f in features]
    cross = torch.stack([t @ f for t, f in zip(targets, features)])
    gram = torch.stack([f.transpose(1, 2) @ f for f in features])
    energy = torch.stack([t.pow(2).sum() for t in targets])
    current = 0.3 * torch.randn(B, m, n, dtype=torch.float64, generator=generator)

    def error(up, k):  # directly on the samples of fold k
        return float((up @ features[k].transpose(1, 2) - targets[k]).pow(2).sum())

    def fit(k, ridge):  # ridge regression towards current on fold k's samples, solved directly
        scale = gram[k].diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
        system = gram[k] + ridge * scale * torch.eye(n, dtype=torch.float64)
        return current + torch.linalg.solve(system, (cross[k] - current @ gram[k]).transpose(1, 2)).transpose(1, 2)

    scores = {None: error(current, 0) + error(current, 1)}
    scores.update({ridge: error(fit(0, ridge), 1) + error(fit(1, ridge), 0) for ridge in REFIT_RIDGES})
    best = min(scores, key=scores.get)
    refitted, report = ridge_refit(current, cross, gram, energy)
    assert report["ridge"] == best is not None
    summed = current + torch.linalg.solve(
        gram.sum(0) + best * gram.sum(0).diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n, dtype=torch.float64),
        (cross.sum(0) - current @ gram.sum(0)).transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(refitted, summed, rtol=1e-8, atol=1e-10)
    total = float(energy.sum())
    assert report["error"] == pytest.approx(((error(current, 0) + error(current, 1)) / total) ** 0.5, rel=1e-9)
    assert report["error_refit"] == pytest.approx(((error(refitted, 0) + error(refitted, 1)) / total) ** 0.5, rel=1e-9)
