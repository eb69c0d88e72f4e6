"""Which implementation runs: Triton on CUDA tensors, Triton's interpreter on CPU tensors when
``TRITON_INTERPRET=1`` (tests), the PyTorch reference otherwise.

``MHA2MLA_KERNELS=reference`` forces the reference, ``MHA2MLA_KERNELS=triton`` forces Triton (an error
if it cannot run). The variable is read on every call.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton
        import triton.language

        del triton
    except Exception:  # any import failure means no Triton
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_backend(*tensors: torch.Tensor) -> str:
    """'triton' or 'reference' for these tensors."""
    wanted = os.environ.get("MHA2MLA_KERNELS", "auto").lower()
    if wanted not in ("auto", "triton", "reference"):
        raise ValueError(f"MHA2MLA_KERNELS={wanted!r}; use auto, triton or reference.")
    if wanted == "reference":
        return "reference"
    on_cuda = all(t.is_cuda for t in tensors)
    can_run = triton_importable() and (on_cuda or (interpreting() and not any(t.is_cuda for t in tensors)))
    if wanted == "triton" and not can_run:
        raise RuntimeError(
            "MHA2MLA_KERNELS=triton but Triton cannot run here; use CUDA tensors, or set TRITON_INTERPRET=1 "
            "before importing mha2mla.kernels for CPU tensors."
        )
    return "triton" if can_run else "reference"


def next_power_of_two(n: int, minimum: int = 16) -> int:
    """Tile width for a dimension of size n (tl.dot needs at least 16)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))
