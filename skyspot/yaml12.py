"""YAML 1.2's core schema on PyYAML: the one number grammar of recipes, overrides and spot traces.

PyYAML implements YAML 1.1, whose implicit types surprise: `010` is 8 (octal), `1:30` is 90
(sexagesimal), `0b11` is 3, `1_000` is 1000, `yes`/`on`/`No` are booleans and a date is a datetime.
YAML 1.2's core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution) knows only

    null   ~ null Null NULL (and the empty scalar)
    bool   true True TRUE false False FALSE
    int    [-+]?[0-9]+   0o[0-7]+   0x[0-9a-fA-F]+          (010 is 10)
    float  [-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?   [-+]?\\.(inf|Inf|INF)   \\.(nan|NaN|NAN)

and everything else is a string. Hand-written over PyYAML rather than a dependency on ruamel.yaml
(which speaks 1.2 natively): PyYAML is already here for SkyPilot, and these four rules and their
constructors are all that differs. The `<<` merge key (a 1.1 extension) stays, once per mapping.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_MERGE = re.compile(r"^(?:<<)$")


def _resolvers(cls) -> None:
    """Replace every implicit resolver of `cls` with the core schema's (int before float: `10` matches both)."""
    cls.yaml_implicit_resolvers = {}
    cls.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
    cls.add_implicit_resolver("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""])
    cls.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
    cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    cls.add_implicit_resolver("tag:yaml.org,2002:merge", _MERGE, ["<"])


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping that gives one key (or the merge key `<<`) twice: an error, with its line."""


class Loader(yaml.SafeLoader):
    """SafeLoader with the core schema's resolvers and constructors, and no key given twice."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                # `<<: *a` then `<<: *b` in one mapping: PyYAML merges both in silence, and which one
                # wins a shared key is a reader's guess; one merge key takes a list (`<<: [*a, *b]`).
                name = "<<" if key_node.tag == "tag:yaml.org,2002:merge" else key_node.value
                if name in seen:
                    what = "merge key '<<'" if name == "<<" else f"key '{name}'"
                    hint = " (merge several with one: `<<: [*a, *b]`)" if name == "<<" else ""
                    raise DuplicateKey(
                        None, None, f"duplicate {what} (first at line {seen[name]}){hint}", key_node.start_mark
                    )
                seen[name] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_bool(self, node):
        value = self.construct_scalar(node)
        if not _BOOL.match(value):  # `!!bool yes`
            raise yaml.constructor.ConstructorError(
                None, None, f"{value!r} is no YAML 1.2 boolean (true/false)", node.start_mark
            )
        return value.lower() == "true"

    def construct_yaml_int(self, node):
        value = self.construct_scalar(node)
        if _INT.match(value):  # also for an explicit `!!int`: `!!int 0b11` is an error, not 3
            try:
                if value.startswith("0o"):
                    return int(value[2:], 8)
                if value.startswith("0x"):
                    return int(value[2:], 16)
                return int(value, 10)
            except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
                pass
        raise yaml.constructor.ConstructorError(None, None, f"{value[:40]!r} is no YAML 1.2 integer", node.start_mark)

    def construct_yaml_float(self, node):
        value = self.construct_scalar(node)
        if not _FLOAT.match(value):
            raise yaml.constructor.ConstructorError(
                None, None, f"{value[:40]!r} is no YAML 1.2 number", node.start_mark
            )
        lowered = value.lower()
        if lowered.endswith(".inf"):
            return -math.inf if lowered.startswith("-") else math.inf
        if lowered == ".nan":
            return math.nan
        return float(value)


Loader.add_constructor("tag:yaml.org,2002:bool", Loader.construct_yaml_bool)
Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)
# YAML 1.2's core schema has no timestamps: `deadline: 2026-05-01T17:00+02:00` stays the text the
# deadline parser reads, and `!!timestamp` is an error like any unknown tag.
del Loader.yaml_constructors["tag:yaml.org,2002:timestamp"]
_resolvers(Loader)


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes a string exactly when the core schema would read it as something else
    (`'010'`, `'0o17'`, `'1e5'`), so what it writes `Loader` reads back as the same value."""


_resolvers(Dumper)


def load(text: str) -> Any:
    """One YAML document under the core schema (what yaml.safe_load does, with this Loader)."""
    loader = Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def compose(text: str):
    """The node tree of one document (for line numbers), resolved as `load` resolves it."""
    return yaml.compose(text, Loader=Loader)


def dump_flow(value: Any) -> str:
    """`value` as one line of flow YAML that `load` reads back to it."""
    return yaml.dump(value, Dumper=Dumper, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip()
