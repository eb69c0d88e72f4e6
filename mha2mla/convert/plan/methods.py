"""The conversion's methods: one step name per kind (convert/steps/registry.py), resolved once into the plan.

The product uses exactly two method sets (``product_methods``): the calibrated one, the best in
docs/benchmarks.md, and the weight-only one (``--calib none``), fast but poor without recovery.
``make_plan`` picks one of them from the options; nothing else chooses methods. The other registered steps are
the ablations that docs/benchmarks.md measured; the tests keep each of them exact at full capacity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# the step modules file their steps in the registry when imported
import mha2mla.convert.steps.lowrank
import mha2mla.convert.steps.norm
import mha2mla.convert.steps.reconstruct
import mha2mla.convert.steps.refit
import mha2mla.convert.steps.rope  # noqa: F401
from mha2mla.convert.steps.registry import FIT_KINDS, STEP_KINDS, STEPS


@dataclass(frozen=True)
class Methods:
    """One step name per kind (see STEP_KINDS), and whether calibration follows the converted model."""

    rope_mixing: str
    rope_compensation: str
    lowrank: str
    kv_norm: str
    refit: str = "none"  # "ridge": value rows and o_proj refitted in closed form on the converted layer
    reconstruct: str = "none"  # "gradient": the layer fitted by gradient descent to the source layer's output
    sequential: bool = True  # calibrate layer i+1 on the converted layers' outputs

    def check(self, profile: str) -> None:
        for kind in STEP_KINDS:
            name = getattr(self, kind)
            if name not in STEPS[kind]:
                raise ValueError(f"unknown {kind} method {name!r}; known: {', '.join(STEPS[kind])}")
            if profile not in STEPS[kind][name].profiles:
                raise ValueError(f"the {kind} method {name!r} cannot produce the {profile} profile")

    @property
    def needs_statistics(self) -> bool:
        return any(STEPS[kind][getattr(self, kind)].needs_statistics for kind in STEP_KINDS)

    @property
    def fits_layers(self) -> bool:
        """A fit step (refit, reconstruction) reads the calibration stream's activations of each layer."""
        return any(STEPS[kind][getattr(self, kind)].needs_activations for kind in FIT_KINDS)

    @property
    def extra_channels(self) -> int:
        return STEPS["kv_norm"][self.kv_norm].extra_channels

    def to_dict(self) -> dict:
        return asdict(self)


def product_methods(profile: str, calibrated: bool, reconstruct: bool = True) -> Methods:
    """The method sets the product offers: calibrated (the default; ``reconstruct=False`` is ``--no-reconstruct``)
    and weight-only. The closed-form refit runs only without reconstruction: reconstruction from the unrefitted
    layer ends better, in fewer steps, than from the refitted one (docs/calibration.md, "reconstruction")."""
    if calibrated:
        return Methods(rope_mixing="activation", rope_compensation="mean", lowrank="attention",
                       kv_norm="neutralised" if profile == "exact" else "stabilized",
                       refit="none" if reconstruct else "ridge",
                       reconstruct="gradient" if reconstruct else "none", sequential=True)
    return Methods(rope_mixing="weight", rope_compensation="none", lowrank="svd",
                   kv_norm="neutralised" if profile == "exact" else "rms", sequential=False)
