"""Model families as data: one JSON file per family (weight-name templates, biases, rope layout).

A family is looked up from a source config's ``architectures`` / ``model_type``; adding a family
means adding a JSON file, never an if/elif on model names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from mha2mla import UserError


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    weights: dict[str, str]
    attention_bias: dict[str, object]
    unsupported_config: dict[str, object] = field(default_factory=dict)
    rope_layout: str = "half"
    sliding_window_key: str | None = None
    fused: dict[str, list[str]] = field(default_factory=dict)  # stored tensor -> the logical tensors stacked in its rows
    scales: dict[str, str] = field(default_factory=dict)  # embedding/attention/residual/logits -> the config key of its multiplier
    rope_layers_key: str | None = None  # config key of a per-layer list: 1 = the layer applies rope, 0 = it does not
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (q_norm / k_norm weights)
    exact: str = ""  # what a full-capacity exact-profile conversion reproduces (inspect, README)
    approximated: str = ""  # what the conversion approximates beyond the rope and rank cuts

    def weight(self, key: str, layer: int | None = None) -> str:
        template = self.weights[key]
        return template.format(layer=layer) if layer is not None else template

    def layer_prefix(self, layer: int) -> str:
        """The prefix of decoder layer ``layer``'s tensors (``model.layers.3.``), taken from its input norm's name."""
        return self.weight("input_layernorm", layer).removesuffix("input_layernorm.weight")

    def fused_with(self, key: str) -> tuple[str, list[str]] | None:
        """(the stored tensor's key, its parts in row order) when logical tensor ``key`` is stored fused."""
        return next(((name, parts) for name, parts in self.fused.items() if key in parts), None)

    def scale(self, kind: str, config: dict) -> float:
        """The source's ``kind`` multiplier (1 where the family has none)."""
        key = self.scales.get(kind)
        value = config.get(key) if key else None
        return 1.0 if value is None else float(value)

    def has_bias(self, projection: str, config: dict) -> bool:
        """Whether ``projection`` (q, k, v or o) carries a bias for this source config."""
        spec = self.attention_bias.get(projection, False)
        if isinstance(spec, str) and spec.startswith("config:"):
            return bool(config.get(spec.removeprefix("config:"), False))
        return bool(spec)


REFUSED_FILE = "refused.json"


@lru_cache(maxsize=1)
def all_families() -> dict[str, Family]:
    families = {}
    for entry in resources.files(__package__).iterdir():
        if entry.name.endswith(".json") and entry.name != REFUSED_FILE:
            data = json.loads(entry.read_text())
            data["architectures"] = tuple(data["architectures"])
            data["model_types"] = tuple(data["model_types"])
            families[data["name"]] = Family(**data)
    return dict(sorted(families.items()))


def supported_architectures() -> list[str]:
    return sorted(arch for family in all_families().values() for arch in family.architectures)


@lru_cache(maxsize=1)
def refused_families() -> list[dict]:
    """Families the DeepSeek-V3 format cannot hold, each with the sentence that says why."""
    return json.loads(resources.files(__package__).joinpath(REFUSED_FILE).read_text())["refused"]


def _names(config: dict) -> tuple[list[str], str | None]:
    """The config's ``architectures`` (a list of class names; one name alone is a list of one) and ``model_type``
    (a name), or one sentence when either is of another kind."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    model_type = config.get("model_type")
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise UserError(f"the source config.json has architectures {json.dumps(architectures)}, which is invalid: it "
                        "must be a list of class names (e.g. [\"LlamaForCausalLM\"]); fix config.json or re-download the model.")
    if model_type is not None and not isinstance(model_type, str):
        raise UserError(f"the source config.json has model_type {json.dumps(model_type)}, which is invalid: it must be "
                        "a model type's name (e.g. \"llama\"); fix config.json or re-download the model.")
    return architectures, model_type


def _refusal(config: dict) -> str | None:
    architectures, model_type = _names(config)
    for entry in refused_families():
        if model_type in entry["model_types"] or any(arch in entry["architectures"] for arch in architectures):
            return f"{', '.join(architectures) or model_type} cannot be converted: {entry['reason']}."
    if config.get("auto_map"):
        return (f"{', '.join(architectures) or model_type} is defined by code shipped with the model (auto_map), which needs "
                "trust_remote_code; mha2mla converts only architectures that transformers itself implements.")
    return None


def family_for_config(config: dict) -> Family:
    """The family of a source ``config.json`` (a dict), or a UserError naming the supported ones."""
    refusal = _refusal(config)
    if refusal:
        raise UserError(refusal)
    architectures, model_type = _names(config)
    for family in all_families().values():
        if any(arch in family.architectures for arch in architectures) or model_type in family.model_types:
            for key, bad_value in family.unsupported_config.items():
                if config.get(key) == bad_value:
                    raise UserError(f"{family.name} sources with `{key}: {bad_value}` are not supported (DeepSeek-V3 MLPs have no bias).")
            return family
    name = ", ".join(architectures) or model_type or "unknown"
    raise UserError(
        f"architecture {name} is not supported; supported architectures are {', '.join(supported_architectures())}."
    )
