"""One number grammar: recipes, overrides and spot traces read scalars as YAML 1.2's core schema.

PyYAML's YAML 1.1 read `train.steps=010` as 8, `1:30` as 90, `0b11` as 3 and `yes`/`on`/`No` as
booleans. `core_schema` below restates the spec's table (https://yaml.org/spec/1.2.2/#1032-tag-resolution)
as the oracle; the property tests feed it the forms YAML 1.1 reads differently (leading-zero,
binary, sexagesimal and underscored integers, 1.1 booleans, infinities, NaN) through overrides,
environment variables and recipe files, and check that every value either reads as the oracle says
or is refused, and that no infinity or NaN reaches the trainer or the controller.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyspot import yaml12
from skyspot.errors import RecipeError, UsageError
from skyspot.recipe import RECIPES_DIR, load_recipe, parse_overrides, value_text

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_NO_VALUE = object()


def core_schema(text: str):
    """What YAML 1.2's core schema reads a plain scalar as (the spec's table, written out)."""
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text, 10)
    if re.fullmatch(r"0o[0-7]+", text):
        return int(text[2:], 8)
    if re.fullmatch(r"0x[0-9a-fA-F]+", text):
        return int(text[2:], 16)
    if re.fullmatch(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?", text):
        return float(text)
    if re.fullmatch(r"[-+]?\.(inf|Inf|INF)", text):
        return -math.inf if text.startswith("-") else math.inf
    if re.fullmatch(r"\.(nan|NaN|NAN)", text):
        return math.nan
    return text


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


_digits = st.text("0123456789", min_size=1, max_size=6)
_sign = st.sampled_from(["", "-", "+"])
_case = lambda words: st.sampled_from(words).flatmap(  # noqa: E731  yes, Yes, YES, yEs ...
    lambda w: st.tuples(*[st.sampled_from([c.lower(), c.upper()]) for c in w]).map("".join)
)

# The scalars YAML 1.1 and 1.2 read differently, and their 1.2 neighbours.
YAML11_FORMS = st.one_of(
    st.builds(lambda s, d: f"{s}0{d}", _sign, _digits),  # 010: 8 in 1.1
    st.builds(lambda s, d: f"{s}0b{d}", _sign, st.text("01", min_size=1, max_size=6)),  # 0b11: 3 in 1.1
    st.builds(lambda s, d: f"{s}0o{d}", _sign, st.text("01234567", min_size=1, max_size=4)),
    st.builds(lambda s, d: f"{s}0x{d}", _sign, st.text("0123456789abcdefABCDEF", min_size=1, max_size=4)),
    st.builds(lambda s, a, b: f"{s}{a}_{b}", _sign, _digits, _digits),  # 1_000
    st.builds(lambda s, a, b: f"{s}{a}:{b}", _sign, _digits, st.integers(0, 59).map(str)),  # 1:30: 90 in 1.1
    st.builds(lambda a, b, c: f"{a}:{b}.{c}", _digits, st.integers(0, 59).map(str), _digits),
    _case(["yes", "no", "on", "off", "y", "n", "true", "false"]),  # yes/on/No
    st.builds(lambda s, w: f"{s}{w}", _sign, _case([".inf", ".nan"])),
    st.builds(
        lambda s, m, e: f"{s}{m}e{e}",
        _sign,
        st.sampled_from(["1", "1.5", "9.9", ".5", "3."]),
        st.sampled_from(["308", "309", "-5", "+400", "4000"]),
    ),  # 1e309 overflows
    st.sampled_from(["~", "null", "Null", "NULL", "1.", ".5", "2026-05-01", "12:30:00", "0", "-0", "00"]),
)


@PROPERTY
@given(YAML11_FORMS)
def test_every_scalar_reads_as_yaml_1_2_says(text):
    assert same(yaml12.load(text), core_schema(text)), text
    assert same(parse_overrides([f"train.steps={text}"])[0][1], core_schema(text) if text else ""), text


@PROPERTY
@given(YAML11_FORMS)
def test_a_value_written_back_as_override_text_reads_back_the_same(text):
    value = core_schema(text)
    assert same(parse_overrides([f"train.lr={value_text(value)}"])[0][1], value), (text, value_text(value))


# Fields of every kind a number can land in: an int, a bool, floats (one of them a time), a free-form config.
FIELDS = {
    "train.steps": int,
    "resources.spot": bool,
    "train.lr": float,
    "checkpoint.every_seconds": float,
    "resources.step_seconds_hint": float,
    "model.config.hidden_size": object,
}


def _read(recipe, key):
    node = recipe
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _finite_everywhere(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite_everywhere, value.values()))
    if isinstance(value, (list, tuple)):
        return all(map(_finite_everywhere, value))
    return True


def _loaded_or_refused(load, key, text):
    try:
        recipe = load()
    except (RecipeError, UsageError) as err:
        assert "\n" not in str(err).strip() or isinstance(err, RecipeError), str(err)
        return _NO_VALUE
    read = _read(recipe, key)
    expected = core_schema(text)
    kind = FIELDS[key]
    if kind is float and type(expected) is int:
        expected = float(expected)  # an integer is a number a float field takes (pydantic's strict mode too)
    assert same(read, expected), f"{key}={text!r} read as {read!r}, YAML 1.2 says {expected!r}"
    assert _finite_everywhere(recipe.model_dump()), f"{key}={text!r} let a non-finite number through"
    return read


@PROPERTY
@given(st.sampled_from(sorted(FIELDS)), YAML11_FORMS)
def test_an_override_or_environment_value_is_read_as_1_2_or_refused(key, text):
    _loaded_or_refused(lambda: load_recipe("tiny", [f"{key}={text}"], environ={}), key, text)
    env = {"SKYSPOT_" + key.upper().replace(".", "__"): text}
    _loaded_or_refused(lambda: load_recipe("tiny", environ=env), key, text)


@PROPERTY
@given(st.sampled_from(["train.steps", "resources.spot", "train.lr", "model.config.hidden_size"]), YAML11_FORMS)
def test_a_recipe_file_value_is_read_as_1_2_or_refused(tmp_path_factory, key, text):
    source = (RECIPES_DIR / "tiny.yaml").read_text()
    leaf = key.rsplit(".", 1)[1]
    indent = "    " if key.startswith("model.config") else "  "
    line = re.compile(rf"^{indent}{leaf}: .*$", re.M)
    assert line.search(source)
    path = tmp_path_factory.mktemp("r") / "r.yaml"
    path.write_text(line.sub(lambda _: f"{indent}{leaf}: {text}", source, count=1))
    _loaded_or_refused(lambda: load_recipe(str(path), environ={}), key, text)


@pytest.mark.parametrize(
    "override, read",
    [
        ("train.steps=010", 10),
        ("train.steps=0o10", 8),
        ("train.steps=0x10", 16),
    ],
)
def test_the_issue_s_integers(override, read):
    assert load_recipe("tiny", [override], environ={}).train.steps == read


@pytest.mark.parametrize(
    "override",
    [
        "train.steps=1:30",
        "train.steps=0b11",
        "train.steps=1_000",
        "train.steps=!!int 0b11",
        "resources.spot=yes",
        "resources.spot=on",
        "resources.spot=No",
        "resources.spot=!!bool yes",
        "train.lr=.nan",
        "train.lr=.inf",
        "train.lr=1e309",
        "resources.step_seconds_hint=.inf",
        "model.config.hidden_size=.nan",
        "deepspeed.extra={a: [1, -.inf]}",
    ],
)
def test_the_issue_s_other_forms_are_errors(override):
    with pytest.raises((RecipeError, UsageError)):
        load_recipe("tiny", [override], environ={})


def test_a_duplicate_merge_key_is_refused_with_its_line(tmp_path):
    source = (RECIPES_DIR / "tiny.yaml").read_text()
    text = source.replace("train:\n", "a: &a {grad_accum: 1}\nb: &b {seed: 7}\ntrain:\n  <<: *a\n  <<: *b\n", 1)
    path = tmp_path / "r.yaml"
    path.write_text(text)
    line = text.splitlines().index("  <<: *b") + 1
    with pytest.raises(RecipeError, match=rf"duplicate merge key '<<'.*line {line - 1}"):
        load_recipe(str(path), environ={})
    with pytest.raises(UsageError, match="duplicate merge key"):
        parse_overrides(["deepspeed.extra={<<: {a: 1}, <<: {b: 2}}"])
    # one merge key with a list is YAML's way to merge several
    assert yaml12.load("a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b], x: 3}")["c"] == {"x": 3, "y": 2}
