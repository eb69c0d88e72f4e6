"""float32 vs bfloat16 matmul rate on this CPU at SmolLM2's layer shapes (one thread, torch's own CPU kernels).

    python benchmarks/matmul_dtypes.py

For each (tokens × in × out) shape it times ``a @ b`` for about a second per dtype and prints GFLOP/s and the ratio,
with the CPU's bf16 flags (mha2mla/compute.py reads the same ones).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((4096, 576, 1536), (4096, 576, 576), (1024, 576, 192), (2048, 2048, 2048))


def rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(2):
        a @ b
    started, runs = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a @ b
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - started) / 1e9


def main() -> int:
    from mha2mla.compute import BF16_ARM_FEATURES, BF16_CPU_FLAGS, cpu_flags

    torch.set_num_threads(1)
    flags = sorted(set(BF16_CPU_FLAGS + BF16_ARM_FEATURES + ("amx_tile",)) & cpu_flags())
    print(f"torch {torch.__version__}, bf16 flags: {', '.join(flags) or 'none'}")
    print("| shape (tokens × in × out) | float32 GFLOP/s | bfloat16 GFLOP/s | × |\n|---|---|---|---|")
    for m, k, n in SHAPES:
        f32, bf16 = rate(m, k, n, torch.float32), rate(m, k, n, torch.bfloat16)
        print(f"| {m} × {k} × {n} | {f32:.3g} | {bf16:.3g} | {bf16 / f32:.3g} |")  # 3 digits: emulated bf16 rounds to 0-2
    return 0


if __name__ == "__main__":
    sys.exit(main())
