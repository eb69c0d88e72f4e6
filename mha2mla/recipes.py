"""Recipe files: one YAML with a section per command (``convert:``, ``recover:``, ``eval:``, ``generate:``), each
holding settings of that command's config model, and the one place where a section and the flags given over it
become that model, or one sentence saying what is wrong (docs/install.md).

A section's keys are checked when the file is read (an unknown key is a typo); its values are checked by the
command's model once the flags are merged in, so a contradiction between the recipe and a flag is caught too."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from mha2mla import UserError
from mha2mla.convert.config import ConvertConfig
from mha2mla.evaluation.config import EvalConfig
from mha2mla.io.recipe_errors import check_recipe_shape, yaml_error_sentence
from mha2mla.modeling.generate_config import GenerateConfig
from mha2mla.train.config import RecoverConfig

SECTIONS: dict[str, type[BaseModel]] = {"convert": ConvertConfig, "recover": RecoverConfig, "eval": EvalConfig,
                                        "generate": GenerateConfig}


class Recipe(BaseModel):
    """A recipe file: the exact command in a comment at the top, then ``source:`` and one section per command."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | None = None
    convert: dict = {}
    recover: dict = {}
    eval: dict = {}
    generate: dict = {}


def _unknown_key(section: dict, model: type[BaseModel], prefix: str = "") -> tuple[str, list[str]] | None:
    """The first key of ``section`` that ``model`` has no field for (nested models by their dotted key), with
    the field names it could have meant."""
    for key, value in section.items():
        field = model.model_fields.get(key)
        if field is None:
            return prefix + str(key), list(model.model_fields)
        nested = field.annotation
        if isinstance(value, dict) and isinstance(nested, type) and issubclass(nested, BaseModel):
            found = _unknown_key(value, nested, f"{prefix}{key}.")
            if found is not None:
                return found
    return None


def _unknown_sentence(path: Path, section: str, key, names: list[str]) -> str:
    """``key`` as YAML gave it: text, or a number or date written where a setting's name belongs."""
    close = difflib.get_close_matches(str(key).rpartition(".")[2], names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"recipe {path} has an unknown {section} setting {key!r}{hint}; fix or remove it."


def load_recipe(path: str | Path) -> Recipe:
    """The recipe at ``path``, every section's keys checked against its command's settings."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"recipe {path} is a folder; pass the path of a recipe YAML file (e.g. {path}/<name>.yaml).")
    if not path.is_file():
        what = "is not a regular file (a device, a pipe or a socket)" if path.exists() else "does not exist"
        raise UserError(f"recipe {path} {what}; pass the path of a recipe YAML file.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise UserError(f"recipe {path} is not UTF-8 text (byte {error.start}); give a YAML file encoded as UTF-8.") from None
    except OSError as error:
        raise UserError(f"cannot read recipe {path} ({error.strerror}).") from None
    except yaml.YAMLError as error:
        raise UserError(yaml_error_sentence(path, error)) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise UserError(f"recipe {path} is nested too deeply to be a recipe; write its settings out flat.") from None
    check_recipe_shape(path, data)
    unknown = sorted((key for key in data if key not in Recipe.model_fields), key=str)  # keys may be numbers
    if unknown:
        raise UserError(_unknown_sentence(path, "top-level", unknown[0], list(Recipe.model_fields)))
    for section, model in SECTIONS.items():
        value = data.get(section)
        if value is not None and not isinstance(value, dict):
            raise UserError(f"recipe {path}: `{section}:` must hold settings (key: value), not {value!r}.")
        found = _unknown_key(value or {}, model)
        if found is not None:
            raise UserError(_unknown_sentence(path, section, *found))
    return Recipe.model_validate({key: _expand_cache(value) for key, value in data.items() if value is not None})


# A recipe names what `make assets` fetched by this variable, so it works from any folder (mha2mla/io/cache.py).
_CACHE_VARIABLE = re.compile(r"\$\{MHA2MLA_CACHE\}|\$MHA2MLA_CACHE\b")


def _expand_cache(value):
    """``$MHA2MLA_CACHE`` (or ``${MHA2MLA_CACHE}``) in a recipe's strings is the cache folder, set or not."""
    if isinstance(value, dict):
        return {key: _expand_cache(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_expand_cache(item) for item in value]
    if isinstance(value, str) and _CACHE_VARIABLE.search(value):
        from mha2mla.io.cache import cache_dir

        return _CACHE_VARIABLE.sub(lambda _: str(cache_dir()), value)
    return value


def merge(base: dict, overrides: dict, replaced: dict[str, tuple[str, ...]] | None = None) -> dict:
    """``base`` with ``overrides`` over it, nested sections key by key. ``replaced`` maps a key to the keys of
    ``base`` it replaces when given (a budget from the command line replaces the recipe's explicit ranks)."""
    merged = dict(base)
    for key in overrides:
        for gone in (replaced or {}).get(key, ()):
            merged.pop(gone, None)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _flat_keys(settings: dict, prefix: str = "") -> set[str]:
    """``{"lora": {"rank": 2}, "seed": 1}`` -> ``{"lora.rank", "seed"}``."""
    keys = set()
    for key, value in settings.items():
        keys |= _flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return keys


def explain(error: ValidationError, section: str, flags: dict[str, str], given: set[str], recipe: Path | None) -> str:
    """The first validation error as one sentence naming the flag (``flags``: setting -> flag) when the setting
    was ``given`` on the command line, else the recipe key that caused it."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"] if isinstance(part, str))
    flag = flags.get(key, "--" + key.replace("_", "-").replace(".", "-"))
    origin = f"`{key}` under `{section}:` in {recipe}" if recipe is not None and key not in given else flag
    message = first["msg"].removeprefix("Value error, ").rstrip(".")
    if first["type"] == "missing":
        return f"give {flag} (or `{key}:` under `{section}:` in a --recipe)."
    if first["type"] == "literal_error":
        return f"{origin} must be one of {first['ctx']['expected']}, not {first['input']!r}."
    if not key:  # a check across settings: its message names them
        return message + "."
    return f"invalid {origin}: {message[0].lower()}{message[1:]}."


def build_settings(section: str, recipe: str | Path | None, given: dict, flags: dict[str, str] | None = None):
    """The command's config model from the recipe's ``section`` with ``given`` (the settings the command line
    gave, nested like the model) over it; ``flags`` names each setting's flag for the error sentence."""
    model = SECTIONS[section]
    path = None if recipe is None else Path(recipe)
    base = getattr(load_recipe(path), section) if path is not None else {}
    merged = merge(base, given, getattr(model, "REPLACED_BY", None))
    try:
        return model.model_validate(merged)
    except ValidationError as error:
        raise UserError(explain(error, section, flags or {}, _flat_keys(given), path)) from None
