"""One place that turns a device name (``--device``, ``--calib-device``, a recipe's ``device``) into a device the
machine has, or one sentence: an unknown name, a CUDA device on a machine without CUDA, a GPU index past the last.

The name is checked as text before torch is imported, so a typo costs no start-up time."""

from __future__ import annotations

import re

from mha2mla import UserError

_NAME = re.compile(r"^(?P<kind>cpu|cuda|mps)(?::(?P<index>\d+))?$")


def _torch_available(kind: str) -> tuple[bool, int]:
    """Whether torch can use ``kind`` here, and how many such devices it sees."""
    import torch

    if kind == "cuda":
        return torch.cuda.is_available(), torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return available, 1 if available else 0


def default_device() -> str:
    """cuda when a CUDA GPU is visible, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str | None, option: str = "--device") -> str:
    """``name`` checked against this machine (None: cuda when available, else cpu); ``option`` names the flag in the
    sentence. Returns the name to hand to torch."""
    if name is None:
        return default_device()
    text = str(name).strip().lower()
    match = _NAME.match(text)
    if match is None:
        raise UserError(f"{option} {name!r} is not a device; use cpu, cuda or cuda:N (the Nth GPU), or mps.")
    kind, index = match["kind"], match["index"]
    if kind == "cpu":
        return "cpu"
    available, count = _torch_available(kind)
    if not available:
        what = "no CUDA GPU is visible" if kind == "cuda" else "this machine has no Apple GPU (MPS)"
        raise UserError(f"{option} {name} was asked for but {what}; use {option} cpu.")
    if index is not None and int(index) >= count:
        raise UserError(f"{option} {name} asks for GPU {index}, but only {count} {kind} device(s) are visible "
                        f"({kind}:0 to {kind}:{count - 1}).")
    return text


def check_device(name: str | None, option: str = "--device") -> None:
    """Refuse a device name this machine cannot use (None: nothing was asked for)."""
    if name is not None:
        resolve_device(name, option)
