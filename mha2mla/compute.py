"""The compute dtype: what the matmul-heavy work (calibration forwards, reconstruction, recovery, decoding) runs in,
decided once per command from ``--compute-dtype auto|float32|bfloat16`` and the device (docs/design.md,
"compute dtype").

``auto`` is bfloat16 where the hardware multiplies bf16 natively — a CUDA GPU that supports it, a CPU that
reports AMX (``amx_bf16``) or AVX-512 BF16 (``avx512_bf16``), or an Arm CPU with the ``bf16`` extension — and
float32 elsewhere, where bf16 would be emulated and slower. The statistics, factorisations, moments and
solves never use it: they stay float32/float64 whatever it is. float32 is the exact setting.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

ComputeDtype = Literal["auto", "float32", "bfloat16"]
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
# CPU feature flags (/proc/cpuinfo) under which bf16 matmuls run on the hardware's own bf16 instructions
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_ARM_FEATURES = ("bf16",)
# The seeds every command accepts (--seed of recover, eval and generate): numpy's generator, which recover seeds
# through accelerate and eval through lm-eval, takes 0 to 2**32 - 1, the narrowest of numpy, torch and random.
MAX_SEED = 2**32 - 1


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as the kernel reports them (x86 ``flags``, Arm ``Features``); empty when unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def cpu_has_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (AMX, AVX-512 BF16 or Arm BF16), from its reported flags."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_CPU_FLAGS + BF16_ARM_FEATURES)


def resolve_compute_dtype(name: str | None, device: str, cpu_bf16: bool = True) -> str:
    """``float32`` or ``bfloat16`` for ``name`` (auto, float32, bfloat16; None is auto) on ``device`` (a torch
    device name: cpu, cuda, cuda:1, mps). ``cpu_bf16=False``: auto stays float32 on every CPU, for a path whose bf16
    was measured harmful there (recover with LoRA: docs/benchmarks.md, "compute dtype"). ``bfloat16`` asked for on a
    CPU without native bf16 is kept, with a warning: it is emulated there."""
    name = "auto" if name is None else str(name).strip().lower()
    if name not in COMPUTE_DTYPES:
        from mha2mla import UserError

        raise UserError(f"--compute-dtype {name!r} is not a compute dtype; use auto, float32 or bfloat16.")
    kind = str(device).split(":")[0]
    if name == "bfloat16" and kind == "cpu" and not cpu_has_bf16():
        # emulated bf16 multiplies far slower than float32 (docs/benchmarks.md, "compute dtype")
        logger.warning("bfloat16 was asked for on a CPU without native bf16 (no AMX or AVX-512 BF16 in /proc/cpuinfo): "
                       "its matmuls are emulated here and run many times slower than float32; use --compute-dtype auto "
                       "or float32 on this machine.")
    if name != "auto":
        return name
    if kind == "cuda":
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    if kind == "cpu":
        return "bfloat16" if cpu_bf16 and cpu_has_bf16() else "float32"
    return "float32"


def torch_dtype(name: str):
    """The torch dtype of a resolved compute dtype name."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
