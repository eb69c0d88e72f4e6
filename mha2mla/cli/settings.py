"""A command's options generated from its config model's fields (as mergekit's ``add_merge_options``): the flag,
the type, the help (the field's description, its default) all come from the field, so no default is written
twice. Every generated option defaults to None: a flag not given leaves the setting to the recipe, or else to
the model's default."""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Literal, Optional, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mha2mla.recipes import build_settings


@dataclass(frozen=True)
class Flags:
    """How a command shows its model's settings: which ones (dotted keys for nested models, ``lora.rank``), which
    are its arguments, under which flag when not ``--`` + the key with dashes, and with which metavar."""

    settings: tuple[str, ...]
    arguments: tuple[str, ...] = ()  # settings that are the command's own arguments (MODEL), not options
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # setting -> ("--lr",) or ("--tasks", "-t")
    metavars: dict[str, str] = field(default_factory=dict)

    def flag(self, key: str) -> str:
        return self.names.get(key, ("--" + key.replace("_", "-").replace(".", "-"),))[0]

    def parameter(self, key: str) -> str:
        return key.replace(".", "_")


def model_field(model: type[BaseModel], key: str) -> FieldInfo:
    """The field of a dotted key (``lora.rank``: the ``rank`` field of the model of ``lora``)."""
    section, _, name = key.partition(".")
    if name:
        return model_field(model.model_fields[section].annotation, name)
    return model.model_fields[section]


def _bare(annotation):
    """``int | None`` -> ``int``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _cli_type(annotation):
    """The type typer parses a setting as: lists stay lists (a repeatable option), tuples are one comma-separated
    text, the rest as they are."""
    bare = _bare(annotation)
    origin = get_origin(bare)
    if origin is list:
        return list[get_args(bare)[0]]
    if origin is tuple or origin is Literal:  # choices are checked by the model, like a recipe's value
        return str
    return bare


def help_text(info: FieldInfo, repeatable: bool = False) -> str:
    """The field's description as a help sentence, with its default (the model's, never a copy)."""
    text = info.description or ""
    if "_" not in text.partition(" ")[0]:  # a sentence, unless it starts with a setting's name
        text = text[:1].upper() + text[1:]
    text += " (repeatable)" if repeatable and "repeat" not in text else ""
    text += ", comma-separated" if get_origin(_bare(info.annotation)) is tuple else ""
    default = None if info.is_required() else info.default
    if default is None or (isinstance(default, list | tuple) and not default):
        return text + "."
    if isinstance(default, list | tuple):
        default = ",".join(map(str, default))
    elif isinstance(default, bool):
        default = "yes" if default else "no"
    elif isinstance(default, str) and get_origin(_bare(info.annotation)) is not Literal:
        default = f"`{default}`"  # a value written as given, not one of the listed choices
    return f"{text}; default {default}."


def option_parameter(model: type[BaseModel], key: str, flags: Flags) -> inspect.Parameter:
    """The typer option of one setting: None unless given, its help and choices from the field."""
    info = model_field(model, key)
    kind = _cli_type(info.annotation)
    names = flags.names.get(key, (flags.flag(key),))
    if kind is bool:
        names = (f"{names[0]}/--no-{names[0].removeprefix('--')}", *names[1:])
    choices = get_args(_bare(info.annotation)) if get_origin(_bare(info.annotation)) is Literal else ()
    metavar = flags.metavars.get(key) or ("[" + "|".join(choices) + "]" if choices else None)
    option = typer.Option(None, *names, help=help_text(info, get_origin(kind) is list), metavar=metavar,
                          show_default=False)
    return inspect.Parameter(flags.parameter(key), inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=Optional[kind])


def nest(flat: dict[str, Any]) -> dict:
    """``{"lora.rank": 8, "seed": None}`` -> ``{"lora": {"rank": 8}}`` (flags not given are dropped)."""
    nested: dict = {}
    for key, value in flat.items():
        if value is None or value == []:
            continue
        section, _, name = key.rpartition(".")
        (nested.setdefault(section, {}) if section else nested)[name] = value
    return nested


def with_settings(section: str, model: type[BaseModel], flags: Flags):
    """Decorate ``body(settings, **own)`` into a typer command whose parameters are ``body``'s own (``settings``
    left out) followed by one option per setting in ``flags``; ``settings`` is the config model built from the
    recipe (``--recipe``, one of ``body``'s own) and the flags given over it."""

    def decorate(body):
        own = [p for p in inspect.signature(body, eval_str=True).parameters.values() if p.name != "settings"]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        generated = {flags.parameter(key): key for key in flags.settings}

        def command(**values):
            given = {generated[name]: values.pop(name) for name in list(values) if name in generated}
            given.update({key: values.pop(key) for key in flags.arguments})
            given = {key: str(value) if isinstance(value, PurePath) else value for key, value in given.items()}
            nested = nest(given)
            recipe = values.get("recipe")
            names = {key: flags.flag(key) for key in flags.settings} | {key: key.upper() for key in flags.arguments}
            return body(settings=build_settings(section, recipe, nested, names), **values)

        parameters = own + [option_parameter(model, key, flags) for key in flags.settings]
        command.__signature__ = inspect.Signature(parameters)
        command.__name__, command.__doc__ = body.__name__, body.__doc__
        return command

    return decorate

