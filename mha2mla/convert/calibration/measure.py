"""What calibration measures at one layer (docs/calibration.md, "how statistics are collected"): the
moments of the attention input x (the input RMSNorm's output), a per-token sample of it, and what the source
attention does with it — per query head, the moments of the attention-averaged inputs, the key-side moments
and the attention mass at each distance.
"""

from __future__ import annotations

import torch

from mha2mla.convert.calibration.stream import LayerActivations
from mha2mla.convert.steps.lowrank import row_space_basis
from mha2mla.convert.steps.records import LayerStatistics
from mha2mla.modeling.eager import eager_attention
from mha2mla.modeling.rmsnorm import rms_norm

# tokens kept per layer (on top of the moments) for statistics that need per-token values
INPUT_SAMPLE_TOKENS = 4096
# attention statistics are taken at every QUERY_STRIDE-th query and KEY_STRIDE-th key position, and at every
# key among the first KEY_DENSE (they receive the most attention)
QUERY_STRIDE = 4
KEY_STRIDE = 4
KEY_DENSE = 16
# keys are weighted by (attention they receive) ** KEY_WEIGHT_POWER (the choice: docs/benchmarks.md)
KEY_WEIGHT_POWER = 0.5
# per-head moments are taken in the K/V row space (2·G·d coordinates) instead of all D inputs when the dense
# ones, 2 · H · D² float32, would pass this size: exact for every step but the latent's own refinement, which it
# confines to that row space, so small models keep the dense moments (docs/calibration.md, "memory")
DENSE_MOMENTS_LIMIT = 8 * 1024**3


@torch.no_grad()
def measure(activations: LayerActivations) -> LayerStatistics:
    """The statistics of the layer of ``activations`` on the stream's hidden states."""
    stream, reader, layer = activations.stream, activations.stream.reader, activations.layer
    norm_weight = reader.tensor("input_layernorm", layer).to(activations.device)
    eps = float(reader.ckpt.config.get("rms_norm_eps", 1e-6))
    hidden = activations.hidden
    D = hidden.shape[-1]
    moment = torch.zeros(D, D, dtype=torch.float64, device=activations.device)
    total = torch.zeros(D, dtype=torch.float64, device=activations.device)
    count = 0
    flat = hidden.reshape(-1, D)  # (N*L, D)
    for start in range(0, flat.shape[0], 4096):
        x = rms_norm(flat[start : start + 4096], norm_weight, eps, keep_float32=True)  # (n, D) float32
        moment += (x.T @ x).double()  # a float32 product per chunk, accumulated in float64
        total += x.double().sum(0)
        count += x.shape[0]
    # per-token sample: evenly spaced tokens plus every sequence's first (attention-sink) token
    length = hidden.shape[1]
    sample_every = max(1, flat.shape[0] // INPUT_SAMPLE_TOKENS)
    index = torch.cat([torch.arange(0, flat.shape[0], sample_every)[:INPUT_SAMPLE_TOKENS],
                       torch.arange(0, flat.shape[0], length)]).unique().to(flat.device)
    sample = rms_norm(flat[index], norm_weight, eps, keep_float32=True)
    H = stream.modules.source_config.num_attention_heads
    basis = None
    if 2 * H * D * D * 4 > DENSE_MOMENTS_LIMIT:
        basis = row_space_basis(reader.tensor("k_proj", layer, ".weight"), reader.tensor("v_proj", layer, ".weight"))
    value_covariances, key_covariances, histogram = attention_statistics(activations, basis)
    return LayerStatistics(
        moment_basis=None if basis is None else basis.cpu(),
        input_covariance=(moment / count).cpu(), input_mean=(total / count).cpu(), num_tokens=count,
        input_sample=sample.cpu(), value_covariances=value_covariances.cpu(),
        key_covariances=key_covariances.cpu(), distance_histogram=histogram.cpu(),
        pair_frequencies=stream.modules.source_rotary.inv_freq.double().cpu(),
    )


@torch.no_grad()
def attention_statistics(activations: LayerActivations, basis: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What the source attention does with this layer's tokens, per query head h: ``E[x̄ x̄ᵀ]`` for the
    attention-averaged inputs x̄_i = Σ_j p_hij x_j (what a value error is seen through), the key-side moment
    E_w[x xᵀ] with each token weighted by the attention it receives (Σ_i p_hij) ** KEY_WEIGHT_POWER, and the
    attention mass at each distance i - j. The moments are of ``basis`` x (m coordinates) when a basis of the
    K/V row space is given."""
    stream, device = activations.stream, activations.device
    N, L, D = activations.hidden.shape
    attention = activations.source.self_attn
    H = stream.modules.source_config.num_attention_heads
    position = torch.arange(L, device=device)
    distance = (position[:, None] - position[None, :]).clamp_min(0).reshape(1, -1).expand(H, -1)
    # keys: every position of the first KEY_DENSE ones, then every KEY_STRIDE-th, each standing for KEY_STRIDE positions
    keys = torch.cat([torch.arange(min(KEY_DENSE, L)), torch.arange(KEY_DENSE, L, KEY_STRIDE)]).to(device)
    key_share = torch.where(keys < KEY_DENSE, 1.0, float(KEY_STRIDE)).to(device)
    # per-head (H, m, m) moments accumulated in float32 (docs/calibration.md, "memory"); each batch's products run in
    # the compute dtype, the matmul rate of the layer forwards (bf16: docs/benchmarks.md, "conversion cost")
    compute = activations.compute
    project = None if basis is None else basis.to(device, compute)  # (m, D)
    m = D if project is None else project.shape[0]
    covariances = torch.zeros(H, m, m, device=device)
    key_covariances = torch.zeros(H, m, m, device=device)
    key_weight = torch.zeros(H, dtype=torch.float64, device=device)
    histogram = torch.zeros(H, L, dtype=torch.float64, device=device)
    with eager_attention(attention.config):  # the probabilities themselves
        for batch in activations.batches():
            x = activations.normed(activations.hidden[batch])  # (b, L, D), compute dtype
            # (b, H, L, L) in the compute dtype (modeling/eager.py); its sums are taken in float32 below
            probabilities = attention(x, position_embeddings=stream.source_rope, attention_mask=stream.causal_mask)[1]
            x = x if project is None else x @ project.T  # (b, L, m)
            averaged = probabilities[:, :, ::QUERY_STRIDE] @ x[:, None]  # (b, H, L/s, m)
            covariances += torch.einsum("bhnd,bhne->hde", averaged, averaged)  # summed into float32
            weight = probabilities.sum(2, dtype=torch.float32)[:, :, keys].clamp_min(0) ** KEY_WEIGHT_POWER * key_share  # (b, H, k)
            weighted = weight.sqrt().to(compute)[..., None] * x[:, None, keys]  # (b, H, k, m)
            key_covariances += torch.einsum("bhnd,bhne->hde", weighted, weighted)
            key_weight += weight.sum((0, 2)).double()
            histogram.scatter_add_(1, distance, probabilities.sum(0, dtype=torch.float32).reshape(H, -1).double())
    queries = N * len(range(0, L, QUERY_STRIDE))
    return (covariances / queries, key_covariances / key_weight.float()[:, None, None],
            histogram / histogram.sum(-1, keepdim=True))
