"""The conversion's per-step loops keep their work on the layer's device, with no host round trip per step (issue 49).

No GPU here, so the CUDA path is checked where a CPU can check it: every read of a tensor's value by the host
(``.item()``, ``float(t)``, ``bool(t)``: a device sync on a GPU) goes through ``aten._local_scalar_dense``, which a
dispatch mode counts. A loop whose count grows with its steps would stall a GPU once per step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

from mha2mla.convert.steps import lowrank, reconstruct
from mha2mla.convert.steps.refit import ridge_refit
from mha2mla.modeling.eager import eager_attention


class HostReads(TorchDispatchMode):
    """Counts the host's reads of tensor values (``aten._local_scalar_dense``) while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def tiny_layer() -> tuple[torch.nn.Module, reconstruct.ReconstructionData]:
    torch.manual_seed(0)
    config = DeepseekV3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=6, q_lora_rank=None,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64)
    config._attn_implementation = "eager"
    module = deepseek.DeepseekV3Attention(config, layer_idx=0).eval()
    N, L = 8, 12
    positions = torch.arange(L)[None]
    rope = deepseek.DeepseekV3RotaryEmbedding(config=config)(torch.zeros(1, L, 1), positions)
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
    x = torch.randn(N, L, 32)
    y = torch.randn(N, L, 32)
    return module, reconstruct.ReconstructionData(x, y, rope, mask)


def test_reconstruction_reads_the_device_once_per_measurement_not_per_step(monkeypatch):
    """Twice the steps add only the extra held-out measurements' reads: one each (the error summed on the device).
    Adam as it runs on a GPU (fused: step counts on the device); the CPU keeps the plain one."""
    monkeypatch.setattr(reconstruct, "FUSED_ADAM_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(reconstruct, "PATIENCE", 1000)  # no early stop: every step runs
    monkeypatch.setattr(reconstruct, "EVAL_EVERY", 5)
    reads = {}
    for steps in (10, 20):
        monkeypatch.setattr(reconstruct, "MAX_STEPS", steps)
        module, data = tiny_layer()
        with eager_attention(module.config), HostReads() as counter:
            report = reconstruct.reconstruct(module, data, exact=False)
        assert report["reconstruction_steps"] == steps
        reads[steps] = counter.count
    assert reads[20] - reads[10] == 2, reads


def test_latent_refinement_reads_nothing_per_step(monkeypatch):
    """The attention-aware latent's Adam steps (lowrank.optimise_down) never read a value back to the host (Adam
    fused as on a GPU)."""
    monkeypatch.setattr(lowrank, "FUSED_ADAM_DEVICES", ("cpu", "cuda"))
    generator = torch.Generator().manual_seed(0)
    m, rows, r = 12, 6, 4
    prepared = []
    for _ in range(3):
        half = torch.randn(m, m, generator=generator)
        cov = half @ half.T / m + torch.eye(m)
        prepared.append((cov, cov @ torch.randn(rows, m, generator=generator).T, 0.5))
    down = torch.randn(r, m, dtype=torch.float64, generator=generator)
    reads = {}
    for steps in (5, 10):
        with HostReads() as counter:
            refined = lowrank.optimise_down(prepared, down, steps, device="cpu")
        reads[steps] = counter.count
        assert refined.dtype == down.dtype and refined.device == down.device
    assert reads[10] == reads[5], reads


def test_ridge_refit_stays_on_the_moments_device():
    """The refit's solve takes its moments where they were accumulated and returns a map there (on a GPU: no copy
    of the (H·d)² moments to the host)."""
    generator = torch.Generator().manual_seed(1)
    f = torch.randn(2, 64, 5, dtype=torch.float64, generator=generator)  # two folds of 64 samples, 5 features
    true = torch.randn(1, 3, 5, dtype=torch.float64, generator=generator)
    t = f @ true[0].T
    cross = torch.stack([(t[k].T @ f[k])[None] for k in (0, 1)])  # (2, 1, 3, 5)
    gram = torch.stack([(f[k].T @ f[k])[None] for k in (0, 1)])  # (2, 1, 5, 5)
    energy = t.pow(2).sum((1, 2))
    refitted, report = ridge_refit(torch.zeros(1, 3, 5, dtype=torch.float64), cross, gram, energy)
    assert refitted.device == cross.device
    assert report["error_refit"] < 1e-3 < report["error"]
    torch.testing.assert_close(refitted, true, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_latent_refinement_device_argument_changes_nothing_on_the_cpu(device):
    generator = torch.Generator().manual_seed(2)
    m = 10
    half = torch.randn(m, m, generator=generator)
    cov = half @ half.T / m + torch.eye(m)
    prepared = [(cov, cov @ torch.randn(4, m, generator=generator).T, 1.0)]
    down = torch.randn(3, m, dtype=torch.float64, generator=generator)
    torch.testing.assert_close(lowrank.optimise_down(prepared, down, 5, device=device),
                               lowrank.optimise_down(prepared, down, 5), rtol=0, atol=0)


@pytest.mark.parametrize("with_basis", [False, True])
def test_attention_aware_latent_on_the_layer_device_changes_nothing_on_the_cpu(with_basis):
    """The whole attention-aware factorisation (the float64 eigendecompositions, the refinement, the per-head
    regressions) runs on the ``device`` it is given, on a GPU the layer's; on the CPU that is the same work, bit for
    bit, and the factors come back where the weights were. The per-head moments stay float32 on the host, moved one
    group (or head) at a time."""
    generator = torch.Generator().manual_seed(3)
    G, H, d, D = 2, 4, 3, 16
    key = torch.randn(G, d, D, dtype=torch.float64, generator=generator)
    value = torch.randn(G, d, D, dtype=torch.float64, generator=generator)
    x = torch.randn(500, D, dtype=torch.float64, generator=generator)
    covariance = x.T @ x / 500
    basis = lowrank.row_space_basis(key.reshape(-1, D), value.reshape(-1, D)) if with_basis else None
    m = D if basis is None else basis.shape[0]
    mixed = [torch.softmax(torch.randn(500, 500, generator=generator, dtype=torch.float64)[:100], -1) @ x for _ in range(H)]
    coords = (lambda a: a) if basis is None else (lambda a: a @ basis.T)
    value_covariances = torch.stack([coords(a).T @ coords(a) / 100 for a in mixed]).float()  # (H, m, m) float32
    key_covariances = torch.stack([coords(x).T @ coords(x) / 500] * H).float()
    assert value_covariances.shape == (H, m, m)
    runs = [lowrank.attention_aware_low_rank(key, value, 4, covariance, value_covariances, key_covariances, steps=5,
                                             basis=basis, device=device) for device in (None, "cpu")]
    for default, placed in zip(*runs):
        assert placed.device == key.device and placed.dtype == default.dtype
        assert torch.equal(default, placed)
    up_k, up_v, down = runs[0]
    assert down.shape == (4, D) and up_k.shape == up_v.shape == (H, d, 4)


def test_a_layers_host_reads_do_not_grow_with_the_calibration_tokens(monkeypatch, tmp_path):
    """A whole default layer (statistics, latent, stabiliser, reconstruction, advance) reads the host the same number
    of times for 16 and for 32 calibration sequences: nothing in the layer's pipeline syncs once per batch or token.
    Fused Adam as on a GPU; every reconstruction measurement runs, so early stopping cannot change the count."""
    from common import build_source

    from mha2mla.convert import pipeline
    from mha2mla.convert.config import ConvertConfig

    monkeypatch.setattr(reconstruct, "FUSED_ADAM_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(lowrank, "FUSED_ADAM_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(reconstruct, "PATIENCE", 1000)
    monkeypatch.setattr(reconstruct, "MAX_STEPS", 20)
    monkeypatch.setattr(reconstruct, "EVAL_EVERY", 10)
    source = build_source(tmp_path / "src", "llama", num_heads=4, num_kv_heads=2)
    convert_layer, counts = pipeline._convert_layer, {}

    for sequences in (16, 32):
        reads = counts.setdefault(sequences, [])

        def counted(reader, layer, stream, reads=reads):
            with HostReads() as counter:
                work = convert_layer(reader, layer, stream)
            reads.append(counter.count)
            return work

        monkeypatch.setattr(pipeline, "_convert_layer", counted)
        options = ConvertConfig(kv_lora_rank=9, rope_dim=8, calib_samples=sequences, calib_seq_len=32)
        pipeline.convert(source, tmp_path / f"out{sequences}", options, progress=False)
    assert len(counts[16]) == 2 and all(count > 0 for count in counts[16])
    assert counts[16] == counts[32], counts
