"""The latent-cache model's linear layers: ``F.linear``, or oneDNN with weights packed once at load for bf16 on CPU.

PyTorch's CPU bf16 ``F.linear`` hands a plain weight to oneDNN, which reorders it into its blocked layout on every
call; for decode (a few rows per call) that reorder costs more than the product itself, so bf16 decode on CPU
would lose most of what bf16 matmuls gain (docs/benchmarks.md). :func:`pack` does the reorder once, at load
(``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU freezing does), and :func:`linear` runs a
packed weight through ``torch.ops.mkldnn._linear_pointwise``: the same oneDNN product, so the same numbers as
``F.linear`` on the unpacked weight. float32 and every other device keep plain ``F.linear``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights for this device and dtype are packed: bf16 on a CPU whose oneDNN can pack them (it refuses
    on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, where bf16 is emulated anyway)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and _can_pack()


@functools.cache
def _can_pack() -> bool:
    """Whether oneDNN packs a bf16 weight on this CPU, tried once on a small one."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError) as error:
        log.debug("bf16 weight packing unavailable (%s); using F.linear", error)
        return False
    return True


def pack(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A (N, K) bf16 CPU weight in oneDNN's blocked layout (an opaque mkldnn tensor), or the weight as it is
    when this PyTorch or CPU cannot pack it (then :func:`linear` uses ``F.linear``)."""
    if weight is None or not _can_pack():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for a plain or a :func:`pack`-ed weight; x (..., K) -> (..., N) in the weight's dtype.
    x is cast to the weight's dtype first (the model's float32 residual stream entering a bf16 matmul)."""
    x = x.to(weight.dtype)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


PACKED_FIELDS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                 "down_proj")


def pack_layer(weights):
    """A :class:`~mha2mla.modeling.weights.LayerWeights` with its linear weights packed (norms, biases and the
    absorbed factors, used by bmm, stay plain)."""
    from dataclasses import replace

    return replace(weights, **{name: pack(getattr(weights, name)) for name in PACKED_FIELDS})
