"""Every key a recipe takes, walked from the recipe's own models (skyspot/recipe.py): its dotted name as an
override spells it (`train.lora.r`), its type, its default and the field's docstring. `skyspot keys`
prints them; nothing here is a second list of keys that could drift from the models."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel
from pydantic.fields import FieldInfo
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
            doc = field.description or _field_docstrings(model).get(name)
            keys.append(Key(dotted, _type_name(field.annotation), default, _first_paragraph(doc)))
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


@functools.lru_cache(maxsize=None)
def _field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """The string under each field of `model`'s class body (recipe.py documents fields that way).

    Read here, for `skyspot keys` alone, rather than through pydantic's `use_attribute_docstrings`,
    which parses the source of every model each time skyspot.recipe is imported (about 30 ms on
    every command that loads a recipe)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(model)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for field, after in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _section(annotation: Any) -> Optional[type[BaseModel]]:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _factory_default(field: FieldInfo) -> Any:
    # cast: called only where a factory is set; one that wants the validated data raises TypeError here
    factory = typing.cast(typing.Callable[[], Any], field.default_factory)
    try:
        return factory()
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
