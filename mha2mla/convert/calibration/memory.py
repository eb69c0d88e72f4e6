"""How much memory one calibrated layer needs, and what to keep on disk (docs/calibration.md, "memory").

A calibrated conversion holds one layer at a time. Its working set is the sum of ``layer_memory``'s terms:
the calibration hidden states (N sequences × L tokens × D, float32; two streams when the refit or the
reconstruction needs the source model's own) with the source attention's head outputs (N × L × H·d),
the source decoder layer in float32, the per-head moments in the K/V row space, the attention
probabilities of one batch, the o_proj refit's moments and the reconstruction's copies. When the whole
does not fit the budget (``max_memory``, default: the memory available when the conversion starts), the
hidden states go to a file-backed buffer the kernel pages in and out; when even the rest does not fit, the conversion stops before any work with one sentence.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from mha2mla.convert.plan.resolve import ConversionPlan
from mha2mla.convert.steps.refit import refit_cache_bytes

GIB = 1024**3
F32, F64 = 4, 8
# attention probabilities of one batch are kept under this many bytes (the batch shrinks for long sequences)
PROBABILITY_BYTES = 512 * 1024**2
def available_memory() -> int:
    """MemAvailable of this machine in bytes (the cgroup limit when lower), 0 when unknown."""
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        return 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def calibration_batch(plan: ConversionPlan) -> int:
    """Sequences per calibration batch: up to 8, fewer when one batch's probabilities would pass PROBABILITY_BYTES."""
    s, length = plan.shape, plan.calibration.seq_len
    return max(1, min(8, PROBABILITY_BYTES // (3 * s.num_heads * length * length * F32)))


def hidden_streams(plan: ConversionPlan) -> int:
    return 2 if plan.methods.sequential and plan.methods.fits_layers else 1


def layer_memory(plan: ConversionPlan) -> dict[str, int]:
    """The terms (bytes) of one calibrated layer's working set; the first is what can go to disk."""
    s, c = plan.shape, plan.calibration
    D, H, G, d, r = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, plan.latent_rank
    tokens = c.samples * c.seq_len
    m = min(D, 2 * G * d)  # the K/V row space the per-head moments live in
    layer_params = 2 * H * d * D + 2 * G * d * D + 3 * D * s.intermediate_size
    batch = calibration_batch(plan)
    terms = {
        # the hidden states, and the source attention's head outputs the refit and the reconstruction share
        "hidden states": (hidden_streams(plan) * D + (H * d if plan.methods.fits_layers else 0)) * tokens * F32,
        "source layer (float32, read + copy)": 2 * layer_params * F32,
        "per-head moments": 2 * H * m * m * F32 + 2 * D * D * F64,
        "latent fit (group moments, float64 work)": (0 if H == G else 2 * G * m * m * F32) + 2 * m * m * F64 + 4 * H * d * D * F64,
        "one batch of attention": batch * (3 * H * c.seq_len * c.seq_len + 4 * c.seq_len * (D + H * (d + r))) * F32,
    }
    if plan.methods.refit != "none":
        terms["o_proj refit moments"] = (2 * (H * d) ** 2 + 2 * D * H * d) * F64 + 2 * (H * d) ** 2 * F64
        terms["refit's kept first pass"] = refit_cache_bytes(tokens, H, plan.kv_lora_rank, D)
    if plan.methods.reconstruct != "none":
        terms["reconstruction inputs and targets"] = 2 * tokens * D * F32
    return terms


def check_budget(plan: ConversionPlan, max_memory_gib: float | None) -> bool:
    """Whether the hidden states should live on disk; a UserError when even the rest exceeds the budget."""
    from mha2mla import UserError

    terms = layer_memory(plan)
    budget = int(max_memory_gib * GIB) if max_memory_gib else available_memory()
    if budget <= 0:
        return False
    total = sum(terms.values())
    rest = total - terms["hidden states"]
    if rest > budget:
        largest = max((k for k in terms if k != "hidden states"), key=terms.get)
        where = f"max_memory {max_memory_gib:g} GiB" if max_memory_gib else f"the {budget / GIB:.1f} GiB this machine has available"
        raise UserError(
            f"a calibrated layer of this model needs about {rest / GIB:.1f} GiB besides its activations (mostly "
            f"{largest}), more than {where}; use --calib-device cuda, fewer --calib-samples, or --calib none.")
    return total > budget


def host_buffer(shape: tuple[int, ...], on_disk: bool) -> torch.Tensor:
    """A float32 CPU tensor: in memory, or backed by a temporary file (deleted with the tensor)."""
    if not on_disk:
        return torch.empty(shape)
    numel = 1
    for size in shape:
        numel *= size
    handle, path = tempfile.mkstemp(prefix="mha2mla-calibration-", suffix=".f32")
    try:
        os.ftruncate(handle, numel * F32)
        tensor = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
    finally:
        os.close(handle)
        os.unlink(path)  # the mapping outlives the name: nothing is left behind, even after kill -9
    return tensor.view(shape)
