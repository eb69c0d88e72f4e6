"""The one place that decides which implementation runs, Triton or the PyTorch reference (docs/kernels.md).

- :func:`choose_backend` decides per call from the tensors: Triton on CUDA tensors, Triton's interpreter on CPU
  tensors when ``TRITON_INTERPRET=1`` (tests), the PyTorch reference otherwise. ``MHA2MLA_KERNELS=reference``
  forces the reference, ``MHA2MLA_KERNELS=triton`` forces Triton (an error if it cannot run). The variable is
  read on every call. ``mha2mla.kernels.ops`` entry points use it when no backend is given.
- :func:`decode_attention_backend` decides once, for the absorbed decode of the latent-cache model
  (docs/generate.md), from its device and its ``decode_attention`` setting; the model then passes the answer
  to ``mha2mla.kernels.ops.latent_cache_decode`` on every step.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from mha2mla import UserError

DECODE_ATTENTION = ("auto", "torch", "kernel")
logger = logging.getLogger(__name__)


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


def _wanted() -> str:
    wanted = os.environ.get("MHA2MLA_KERNELS", "auto").lower()
    if wanted not in ("auto", "triton", "reference"):
        raise ValueError(f"MHA2MLA_KERNELS={wanted!r}; use auto, triton or reference.")
    return wanted


def _triton_can_run(on_cuda: bool, on_cpu: bool) -> bool:
    """Triton runs compiled on CUDA, or in its interpreter on CPU tensors under TRITON_INTERPRET=1."""
    return triton_importable() and (on_cuda or (interpreting() and on_cpu))


def choose_backend(*tensors: torch.Tensor) -> str:
    """'triton' or 'reference' for these tensors."""
    wanted = _wanted()
    if wanted == "reference":
        return "reference"
    can_run = _triton_can_run(all(t.is_cuda for t in tensors), not any(t.is_cuda for t in tensors))
    if wanted == "triton" and not can_run:
        raise RuntimeError(
            "MHA2MLA_KERNELS=triton but Triton cannot run here; use CUDA tensors, or set TRITON_INTERPRET=1 "
            "before importing mha2mla.kernels for CPU tensors."
        )
    return "triton" if can_run else "reference"


def decode_attention_backend(device: str | torch.device, choice: str = "auto") -> str:
    """'triton' or 'reference' for the latent-cache model's absorbed decode on ``device``.

    ``choice`` "torch" is always the PyTorch reference; "kernel" insists on the Triton split-KV kernel (on CUDA,
    or on CPU under ``TRITON_INTERPRET=1``) and is a UserError where it cannot run; "auto" follows
    ``MHA2MLA_KERNELS`` and otherwise takes the kernel on CUDA and the reference on CPU (the interpreter is
    never chosen by itself: it is slow), with a warning when CUDA lacks Triton."""
    if choice not in DECODE_ATTENTION:
        raise UserError(f"decode attention {choice!r} is not one of {', '.join(DECODE_ATTENTION)}.")
    if choice == "torch":
        return "reference"
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    can_run = _triton_can_run(on_cuda, device.type == "cpu")
    if choice == "kernel":
        if not can_run:
            raise UserError(f"the Triton decode kernel cannot run on {device} here (it needs CUDA with Triton, or "
                            "TRITON_INTERPRET=1 on CPU); use decode attention 'torch' or 'auto'.")
        return "triton"
    wanted = _wanted()
    if wanted == "reference" or (wanted == "auto" and not on_cuda):
        return "reference"
    if wanted == "triton" and not can_run:
        raise UserError(f"MHA2MLA_KERNELS=triton but Triton cannot run on {device} here; unset it or use CUDA.")
    if not can_run:
        logger.warning("Triton is not available; decoding with the PyTorch absorbed attention on %s.", device)
        return "reference"
    return "triton"


@functools.cache
def multiprocessor_count(device: torch.device) -> int | None:
    """The GPU's streaming multiprocessors (132 on an H200), what grids are sized to fill; None off CUDA. Cached:
    the decode asks on every step."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count
