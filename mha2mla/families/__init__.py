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

    def weight(self, key: str, layer: int | None = None) -> str:
        template = self.weights[key]
        return template.format(layer=layer) if layer is not None else template

    def has_bias(self, projection: str, config: dict) -> bool:
        """Whether ``projection`` (q, k, v or o) carries a bias for this source config."""
        spec = self.attention_bias.get(projection, False)
        if isinstance(spec, str) and spec.startswith("config:"):
            return bool(config.get(spec.removeprefix("config:"), False))
        return bool(spec)


@lru_cache(maxsize=1)
def all_families() -> dict[str, Family]:
    families = {}
    for entry in resources.files(__package__).iterdir():
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text())
            data["architectures"] = tuple(data["architectures"])
            data["model_types"] = tuple(data["model_types"])
            families[data["name"]] = Family(**data)
    return dict(sorted(families.items()))


def supported_architectures() -> list[str]:
    return sorted(arch for family in all_families().values() for arch in family.architectures)


def family_for_config(config: dict) -> Family:
    """The family of a source ``config.json`` (a dict), or a UserError naming the supported ones."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
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
