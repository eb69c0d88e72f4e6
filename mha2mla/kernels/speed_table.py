"""Which attention ``recover --attn-implementation auto`` trains with: the Triton MLA kernel only where a GPU
measurement shows it at least as fast as SDPA, forward and backward, for that GPU, compute dtype and head dims;
SDPA everywhere else (docs/kernels.md, "recover's attention auto").

The table is data: one row per timed shape, written from ``benchmarks/kernels_bench.py``'s JSON (its
``speed_table_rows``, printed by ``benchmarks/gpu_check.sh``). It is empty until a GPU run fills it, so today
``auto`` is SDPA everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

TRITON_ATTENTION = "mha2mla_triton"
SDPA = "sdpa"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSpeed:
    """One timed shape: the kernel's speed over SDPA's (SDPA's time / the kernel's) on a GPU whose name holds
    ``gpu``, in ``dtype``, at these head dims."""

    gpu: str  # a substring of torch.cuda.get_device_name(), e.g. "H200"
    dtype: str  # "bfloat16", "float16" or "float32"
    d_nope: int
    d_rope: int
    d_v: int
    forward_speedup: float
    backward_speedup: float


# Filled from a GPU run of benchmarks/gpu_check.sh (its speed-table rows); docs/benchmarks.md holds the figures.
MEASURED: tuple[KernelSpeed, ...] = ()


def head_dims(model_config: dict) -> tuple[int, int, int]:
    """(d_n, d_r, d_v) of a DeepSeek-V3 config.json."""
    return (int(model_config.get("qk_nope_head_dim", 0)), int(model_config.get("qk_rope_head_dim", 0)),
            int(model_config.get("v_head_dim", 0)))


def kernel_row(gpu_name: str, dtype: str, dims: tuple[int, int, int], table=MEASURED) -> KernelSpeed | None:
    """The table's row for this GPU, dtype and head dims, or None."""
    for row in table:
        if row.gpu.lower() in gpu_name.lower() and row.dtype == dtype and (row.d_nope, row.d_rope, row.d_v) == dims:
            return row
    return None


def training_attention(device_type: str, compute_dtype: str, model_config: dict, gpu_name: str | None = None,
                       table=MEASURED) -> str:
    """``mha2mla_triton`` where ``table`` has a row for this CUDA GPU, compute dtype and the model's head dims with
    the kernel at least as fast as SDPA both ways; ``sdpa`` otherwise. Logs what runs and why."""
    dims = head_dims(model_config)
    if device_type != "cuda":
        logger.info("attention auto: sdpa (the Triton MLA kernel is chosen on CUDA only; this run is on %s)",
                    device_type)
        return SDPA
    if gpu_name is None:
        import torch

        gpu_name = torch.cuda.get_device_name()
    row = kernel_row(gpu_name, compute_dtype, dims, table)
    shape = f"d_n {dims[0]}, d_r {dims[1]}, d_v {dims[2]} in {compute_dtype} on {gpu_name}"
    if row is None:
        logger.info("attention auto: sdpa (no measurement of the Triton MLA kernel for %s)", shape)
        return SDPA
    if min(row.forward_speedup, row.backward_speedup) < 1.0:
        logger.info("attention auto: sdpa (the Triton MLA kernel is slower than SDPA for %s: forward x%.2f, "
                    "backward x%.2f)", shape, row.forward_speedup, row.backward_speedup)
        return SDPA
    logger.info("attention auto: %s (at least as fast as SDPA for %s: forward x%.2f, backward x%.2f)",
                TRITON_ATTENTION, shape, row.forward_speedup, row.backward_speedup)
    return TRITON_ATTENTION
