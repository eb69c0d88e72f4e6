"""The registry of per-layer steps: every step a conversion runs is looked up here by kind and name.

A layer passes through the kinds in :data:`STEP_KINDS` order (docs/design.md §3): ``rope_mixing`` (which
mix of the KV heads becomes the shared rope key), ``rope_compensation`` (what reads the key content that
lost its rotation), ``lowrank`` (the latent and its up-projections), ``kv_norm`` (what becomes of
kv_a_layernorm), then, on the assembled layer, ``refit`` (the read-out refitted in closed form) and
``reconstruct`` (the layer fitted by gradient descent). Every step has one signature,
``function(work: LayerWork) -> None``: it reads the slots earlier steps filled and fills its own.
``plan/methods.py`` resolves one name per kind once; nothing downstream compares names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

STEP_KINDS = ("rope_mixing", "rope_compensation", "lowrank", "kv_norm", "refit", "reconstruct")
LATENT_KINDS = STEP_KINDS[:4]  # before the layer's tensors are assembled
FIT_KINDS = STEP_KINDS[4:]  # on the assembled layer, with the calibration stream


@dataclass(frozen=True)
class Step:
    function: Callable  # (work: LayerWork) -> None
    needs_statistics: bool  # reads calibration statistics (fails without them)
    needs_activations: bool  # reads the calibration stream's activations of the layer (refit, reconstruction)
    profiles: tuple[str, ...]  # the output profiles it can produce
    extra_channels: int  # latent channels it adds beside the real latent (counted in kv_lora_rank)


STEPS: dict[str, dict[str, Step]] = {kind: {} for kind in STEP_KINDS}


def register(kind: str, name: str, *, needs_statistics: bool = False, needs_activations: bool = False,
             profiles=("portable", "exact"), extra_channels: int = 0):
    """Decorator: file ``function`` under ``kind``/``name``."""
    def decorate(function: Callable) -> Callable:
        STEPS[kind][name] = Step(function, needs_statistics or needs_activations, needs_activations, tuple(profiles),
                                 extra_channels)
        return function

    return decorate


def step(kind: str, name: str) -> Step:
    return STEPS[kind][name]


def require(value, what: str, method: str):
    """``value``, or a ValueError saying that ``method`` needs calibration statistics ``what``."""
    if value is None:
        raise ValueError(f"the {method} method needs calibration statistics ({what}); convert with calibration")
    return value


@register("refit", "none")
@register("reconstruct", "none")
def no_fit(work) -> None:
    """Leave the assembled layer as it is."""
