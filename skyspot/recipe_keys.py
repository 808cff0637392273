"""Every key a recipe takes, walked from the recipe's own models (skyspot/recipe.py): its dotted name as an
override spells it (`train.lora.r`), its type, its default and the field's docstring. `skyspot keys`
prints them; nothing here is a second list of keys that could drift from the models."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Key:
    name: str  # dotted, as an override spells it
    type: str
    default: Any  # PydanticUndefined when required
    description: str

    @property
    def required(self) -> bool:
        return self.default is PydanticUndefined


def recipe_keys(model: Optional[type[BaseModel]] = None, prefix: str = "") -> list[Key]:
    """The leaf keys of `model` (default: the whole recipe), depth first in declaration order.
    A section that may be absent (`train.lora`) is listed as a key too, before its own keys."""
    if model is None:
        from skyspot.recipe import Recipe

        model = Recipe
    keys: list[Key] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _section(field.annotation)
        default = field.get_default(call_default_factory=False) if field.default_factory is None else None
        if field.default_factory is not None:
            default = "{}" if section else _factory_default(field)
        if section is None or _optional(field.annotation):
            keys.append(Key(dotted, _type_name(field.annotation), default, _first_paragraph(field.description)))
        if section is not None:
            keys.extend(recipe_keys(section, dotted + "."))
    return keys


def value_at(recipe: BaseModel, dotted: str) -> Any:
    """The recipe's value for a dotted key (None inside an absent optional section)."""
    value: Any = recipe
    for part in dotted.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    return value


def _section(annotation: Any) -> Optional[type[BaseModel]]:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _factory_default(field) -> Any:
    try:
        return field.default_factory()
    except TypeError:  # a factory that wants the validated data: no plain default to show
        return None


def _type_name(annotation: Any) -> str:
    """`Optional[int]` -> `int or null`, `list[str]` -> `list[str]`, a Literal -> its values."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]" if args else origin.__name__
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _first_paragraph(text: Optional[str]) -> str:
    return " ".join((text or "").split("\n\n")[0].split())
