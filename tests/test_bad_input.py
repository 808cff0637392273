"""Bad input: whatever a recipe file, an override or the command line holds, skyspot answers
with a valid task (exit 0, YAML that parses) or with one line `error: ...` and a non-zero exit.
Never a traceback, never a half-written file.

Property-based (hypothesis), bounded so the module runs in about two minutes here (the bounded
tests over every command take most of it). SkyPilot's own parser is too slow for the loops;
`test_valid_examples_parse_with_skypilot` feeds it a few. The last section holds every command to a
time and memory bound per case (tests/bounds.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis.control import currently_in_test_context, event
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.errors import UsageError
from skyspot.ledger import Ledger, skyspot_home
from skyspot.recipe import RECIPES_DIR, REGISTRY, Recipe, recipe_path
from tests.cli.test_status_cost_cli import make_run
from tests.conftest import REPO

runner = CliRunner()

FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

TASK_KEYS = {"name", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup", "run"}
SENTINEL = "# a file the user had before: a failed render must leave it as it was\n"


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env, catch_exceptions=True)


def _count(kind: str) -> str:
    if currently_in_test_context():  # `--hypothesis-show-statistics` shows how often each outcome came
        event(kind)
    return kind


def outcome(result) -> str:
    """'ok', 'error' (ours: one line) or 'usage' (Click's own parser), after checking each promise."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    if result.exit_code == 0:
        return _count("ok")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.stdout == "", "a failed command printed data"
    if lines and lines[-1].startswith("Error: "):
        # An unknown option or a missing argument, reported by Click before any skyspot code runs
        # (with its "Usage:" lines when it knows the command).
        assert result.exit_code == 2 and all(line.startswith(("Usage: ", "Try ", "Error: ")) for line in lines), (
            result.stderr
        )
        return _count("usage")
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.exit_code in (1, 2)
    return _count("error")


def assert_valid_task(text: str) -> dict:
    """The YAML parses to a task with only the keys skyspot writes; the header stays a comment."""
    task = yaml.safe_load(text)
    assert isinstance(task, dict)
    assert set(task) <= TASK_KEYS and {"name", "num_nodes", "resources", "envs", "setup", "run"} <= set(task)
    header = text[: text.index("\nname: ")].splitlines()
    assert header and all(line.startswith("# ") for line in header), header
    assert isinstance(task["num_nodes"], int) and 1 <= task["num_nodes"] <= 1024
    assert task["resources"]["ordered"] and isinstance(task["run"], str)
    return task


# --------------------------------------------------------------------------- strategies

NASTY_TEXT = [
    "",
    " ",
    "\n",
    "x\ny",
    "\r\n",
    "\x00",
    "\x07",
    "\x85",
    "\u2028",
    "\u2029",
    "\ufeff",
    "\u202e",
    "\udcff",
    "é",
    "😀",
    "${HOME}",
    "$(touch pwned)",
    "`touch pwned`",
    "x; rm -rf /",
    "'",
    '"',
    "\\",
    "---",
    "...",
    "- a",
    "a: b",
    "{",
    "[",
    "&a",
    "*a",
    "!!python/object/apply:os.system ['true']",
    "1e400",
    "-1",
    "0",
    "10000000000000000000000",
    "nan",
    ".inf",
    "null",
    "~",
    "yes",
    "no",
    "../../etc/passwd",
    "/etc/passwd",
    "s3://",
    "file:///etc",
    "hf://",
    "H100:0",
    "H100:1e3",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(NASTY_TEXT),
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.sampled_from(NASTY_TEXT), inner, max_size=3)
    ),
    max_leaves=8,
)

BASES = {name: yaml.safe_load((RECIPES_DIR / file).read_text()) for name, file in REGISTRY.items()}


def _dict_paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _dict_paths(value, prefix + (key,))


def _parent(data, path):
    for key in path[:-1]:
        data = data[key]
    return data


def _plausible(value):
    """A value of the same kind as `value`, often valid: so mutations reach rendering, not only errors."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(min_value=0, max_value=5000) | st.integers()
    if isinstance(value, float):
        return st.floats(min_value=1e-9, max_value=1.0) | st.floats()
    if isinstance(value, str):
        return st.text(max_size=20) | st.sampled_from(NASTY_TEXT) | st.just(value + "x")
    if isinstance(value, list) and value:
        return st.lists(st.sampled_from(value), max_size=len(value) + 1)
    return junk


@st.composite
def mutated_recipes(draw):
    """A shipped recipe with 1-3 mutations: a key set to junk, deleted, renamed, or a key added."""
    data = copy.deepcopy(BASES[draw(st.sampled_from(sorted(BASES)))])
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_dict_paths(data))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _parent(data, path), path[-1]
        op = draw(st.sampled_from(["like", "like", "like", "set", "delete", "rename", "add"]))
        if op == "like":
            parent[key] = draw(_plausible(parent[key]))
        elif op == "set":
            parent[key] = draw(junk)
        elif op == "delete":
            del parent[key]
        elif op == "rename":
            parent[draw(st.text(max_size=8) | st.sampled_from(NASTY_TEXT))] = parent.pop(key)
        else:
            target = parent[key] if isinstance(parent[key], dict) else parent
            target[draw(st.text(max_size=8) | st.sampled_from(NASTY_TEXT))] = draw(junk)
    return data


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _leaf_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


RECIPE_KEYS = _leaf_keys(Recipe) + [
    "model.config.hidden_size",
    "model.config.x",
    "deepspeed.extra.zero_optimization",
    "train",
    "model.config",
    "resources.accelerators.0",
]

PLAUSIBLE_VALUES = [
    "true",
    "false",
    "aws",
    "gcp",
    "azure",
    "aws,gcp",
    "[aws, gcp]",
    "3e-4",
    "0.5",
    "H100:8",
    "A100-80GB:8,H100:8",
    "us-east-1",
    "[us-east-1, us-central1]",
    "s3://my-bucket/x",
    "gs://data/x.jsonl",
    "hf://org/name",
    "synthetic",
    "text",
    "auto",
    "none",
    "cpu",
    "2+",
    "meta-llama/Llama-3.1-8B",
    "x y",
]
override_values = st.one_of(
    st.integers(min_value=0, max_value=2000).map(str),
    st.sampled_from(PLAUSIBLE_VALUES),  # often valid
    st.text(max_size=24),
    st.sampled_from(NASTY_TEXT),
    junk.map(json.dumps),
    st.integers().map(str),
    st.sampled_from(["[aws, oracle]", "H100:8,A100:8", "s3://my-bucket/x y", "{a: 1}", "[]"]),
)
SHIPPED_VALUES = sorted(
    {
        (".".join(path), json.dumps(_parent(data, path)[path[-1]]))
        for data in BASES.values()
        for path in _dict_paths(data)
        if not isinstance(_parent(data, path)[path[-1]], dict)
    }
)
# key=value with a value like the shipped one (JSON is YAML): these often render.
plausible_overrides = st.sampled_from(SHIPPED_VALUES).flatmap(
    lambda kv: _plausible(json.loads(kv[1])).map(lambda v: f"{kv[0]}={json.dumps(v)}")
)
overrides = st.one_of(
    plausible_overrides,
    plausible_overrides,
    plausible_overrides,
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(RECIPE_KEYS), override_values),
    st.builds(lambda k, v: f"{k}={v}", st.text(max_size=12), override_values),
    st.text(max_size=20),
    st.sampled_from(["=", "train.steps", "train.steps==3", " train.steps=3", "TRAIN.STEPS=3"]),
)


def _safe_path_text(s: str) -> bool:
    # Random tokens can land as an `-o` value; as root, keep them inside the test's directory.
    return not s.startswith(("/", "~")) and ".." not in s and "\x00" not in s


arg_text = st.text(max_size=16).filter(_safe_path_text)


# --------------------------------------------------------------------------- recipe files


def _render_file(tmp_path: Path, content: bytes, use_output: bool):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    target = tmp_path / "out" / "task.yaml"
    target.parent.mkdir(exist_ok=True)
    target.write_text(SENTINEL)
    before = sorted(os.listdir(target.parent))
    result = invoke("render", recipe, *(["-o", target] if use_output else []))
    kind = outcome(result)
    assert sorted(os.listdir(target.parent)) == before, "a temp file was left behind"
    if kind == "ok":
        assert_valid_task(target.read_text() if use_output else result.stdout)
    else:
        assert target.read_text() == SENTINEL
    return kind


@FUZZ
@given(data=mutated_recipes(), allow_unicode=st.booleans(), use_output=st.booleans())
def test_a_mutated_recipe_renders_or_fails_in_one_line(tmp_path, data, allow_unicode, use_output):
    text = yaml.safe_dump(data, allow_unicode=allow_unicode, sort_keys=False)
    _render_file(tmp_path, text.encode("utf-8", "surrogatepass"), use_output)


@FUZZ
@given(document=junk, use_output=st.booleans())
def test_any_yaml_document_renders_or_fails_in_one_line(tmp_path, document, use_output):
    text = yaml.safe_dump(document, allow_unicode=True)
    kind = _render_file(tmp_path, text.encode("utf-8", "surrogatepass"), use_output)
    assert kind == "error"  # nothing random is a complete recipe


@settings(FUZZ, max_examples=60)
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_any_bytes_as_a_recipe_fail_in_one_line(tmp_path, content):
    assert _render_file(tmp_path, content, use_output=True) == "error"


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\n" + "[" * 3000 + "]" * 3000 + "\n", "malformed YAML"),
        ("a: &a [*a]\n", "aliases"),
        (
            "a: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
            "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
            "aliases",
        ),
        ("!!python/object/apply:os.system ['touch pwned']\n", "malformed YAML"),
        ("\ufeffname: x\n\x00\n", "malformed YAML"),
    ],
)
def test_hostile_yaml_is_refused_quickly(tmp_path, monkeypatch, text, message):
    """Deep nesting, self-referencing and exponential aliases, python tags: one line, nothing run."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(text)
    result = invoke("render", path)
    assert outcome(result) == "error" and message in result.stderr
    assert not (tmp_path / "pwned").exists()


def test_an_oversized_recipe_file_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text((RECIPES_DIR / "tiny.yaml").read_text() + "#" * (2 << 20))
    result = invoke("render", path)
    assert outcome(result) == "error" and "larger than" in result.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("description=x\nfile_mounts: {/root/.ssh: ~/.ssh}", "one line"),  # would inject a task key via the header
        ("description=a\x07b", "one line"),  # would make the YAML unparseable
        ("train.lr=.inf", "finite"),
        ("train.steps=100000000000000000000000", "less than or equal"),  # past SQLite's int64
        ("train.seed=-1", "greater than or equal"),
        ("resources.accelerators=[H100:²]", "integer from 1 to 64"),
        ("resources.cpus=2; rm -rf /", "resources.cpus"),
        ('resources.regions=["us-east-1\\n"]', "resources.regions"),
        ("data.source=ftp://host/x", "unsupported data source scheme"),
        ("data.source=s3://", "has no bucket"),
        ("model.hub_id=../../etc", "not a Hugging Face repo id"),
        ('storage.store="s3://bucket/x\\ny"', "one line"),
    ],
)
def test_values_that_would_break_the_task_are_refused(override, message):
    result = invoke("render", "llama8b", override)
    assert outcome(result) == "error" and message in result.stderr, result.stderr


def test_a_file_store_uri_is_a_local_path_not_a_bucket_mount():
    # A cloud render refuses it as launch does (a store on this machine); a local dry run renders it unmounted.
    refused = invoke("render", "llama8b", "storage.store=file:///tmp/runs")
    assert refused.exit_code == 2 and "storage.store /tmp/runs is a directory on this machine" in refused.stderr
    task = assert_valid_task(
        invoke("launch", "llama8b", "--local", "--dry-run", "storage.store=file:///tmp/runs").stdout
    )
    assert list(task["file_mounts"]) == ["/skyspot/package"] and "storage.store=/tmp/runs" in task["run"]


# --------------------------------------------------------------------------- overrides


@FUZZ
@given(
    recipe=st.sampled_from(sorted(REGISTRY)),
    pairs=st.lists(plausible_overrides, min_size=1, max_size=3) | st.lists(overrides, min_size=1, max_size=3),
    use_output=st.booleans(),
)
def test_any_overrides_render_or_fail_in_one_line(tmp_path, recipe, pairs, use_output):
    target = tmp_path / "task.yaml"
    target.write_text(SENTINEL)
    # "--" keeps an override that starts with "-" an override, as a user would have to write it.
    result = invoke("render", recipe, *(["-o", target] if use_output else []), "--", *pairs)
    kind = outcome(result)
    assert kind != "usage"
    if kind == "ok":
        assert_valid_task(target.read_text() if use_output else result.stdout)
    else:
        assert target.read_text() == SENTINEL


@settings(FUZZ, max_examples=40)
@given(
    name=st.sampled_from(
        [
            "SKYSPOT_TRAIN__STEPS",
            "SKYSPOT_RESOURCES__CLOUDS",
            "SKYSPOT_BOGUS__KEY",
            "SKYSPOT_MODEL__CONFIG__X",
            "SKYSPOT_TRAIN__LR",
        ]
    ),
    value=override_values.filter(lambda v: "\x00" not in v),
)
def test_any_environment_override_renders_or_fails_in_one_line(name, value):
    kind = outcome(invoke("render", "tiny", env={name: value}))
    assert kind in ("ok", "error")


# --------------------------------------------------------------------------- command lines

OPTION_TOKENS = [
    "--json",
    "--csv",
    "-a",
    "--all",
    "-o",
    "-n",
    "--clouds",
    "--store",
    "--no-on-demand-fallback",
    "--plot",
    "--help",
    "-y",
    "--",
    "-",
    "--bogus",
    "--local",
    "--cloud",
    "--notice",
    "--grace",
    "--preempt-at-steps",
    "--preempt-every",
    "--simulate",
    "--fallback-after",
    "-d",
]
VALUE_TOKENS = [
    "lama70b",
    "tiny.yaml",
    "recipes/tiny.yaml",
    "missing.yaml",
    "etc/passwd",
    "aws,gcp",
    "aws,oracle",
    "",
    "s3://my-bucket/runs",
    "s3://Bad_Bucket/x",
    "gs://b",
    "ftp://x/y",
    "out.yaml",
    "sub/out.yaml",
    "nodir/x/y.yaml",
    ".",
    "sub",
    "train.steps=3",
    "train.steps=x",
    "resources.num_nodes=0",
    "-1",
    "1e9",
    "15,40",
    "x,y",
    "gcp",
    "oracle",
    "run-1",
    "../x",
    "a/b",
    "UPPER",
]
junk_tokens = st.one_of(st.sampled_from(OPTION_TOKENS), st.sampled_from(VALUE_TOKENS), arg_text)
recipe_args = st.sampled_from(sorted(REGISTRY) * 3 + ["recipes/tiny.yaml", "lama70b", "missing.yaml", ""]) | arg_text


@st.composite
def command_lines(draw):
    """Mostly well-formed command lines for each read-only command, with junk mixed in."""
    command = draw(st.sampled_from(["render", "launch", "recipes", "ls", "status", "cost-report", "prices"]))
    flags = lambda *choices: draw(st.lists(st.sampled_from(choices), max_size=2, unique=True))  # noqa: E731
    if command == "render":
        args = ["render", draw(recipe_args)]
        if draw(st.booleans()):
            args += ["-o", draw(st.sampled_from(["out.yaml", "sub/out.yaml", "nodir/x.yaml", "sub", "."]) | arg_text)]
        args += draw(st.lists(overrides, max_size=2))
    elif command == "launch":
        # --dry-run first: nothing after it can turn it off, so nothing is ever launched.
        args = ["launch", "--dry-run", draw(recipe_args)]
        for option in flags("-n", "--clouds", "--store", "--no-on-demand-fallback", "--local", "-y", "-d"):
            args.append(option)
            if option in ("-n", "--clouds", "--store"):
                args.append(draw(st.sampled_from(VALUE_TOKENS + ["my-run", "aws", "gcp,azure"]) | arg_text))
        args += draw(st.lists(overrides, max_size=2))
    elif command in ("recipes", "ls", "prices"):
        args = [command, *flags("--json")]
    elif command == "status":
        args = ["status", *flags("--json", "-a")]
    else:
        args = ["cost-report", *draw(st.lists(st.sampled_from(["run-1", "nope"]) | arg_text, max_size=1))]
        for flag in flags("--json", "--csv", "--plot"):
            args += [flag, "plot.png"] if flag == "--plot" else [flag]
    if draw(st.integers(0, 3)) == 0:
        args.insert(draw(st.integers(1, len(args))), draw(junk_tokens))
    return args


@pytest.fixture
def no_submission(monkeypatch):
    """Whatever the fuzzer types, nothing is launched: reaching an executor fails the test."""
    import skyspot.executors.local.executor as local
    import skyspot.executors.sky.sdk as sky_executor

    def refuse(*args, **kwargs):
        raise AssertionError("a fuzzed command line reached an executor")

    monkeypatch.setattr(local, "launch_local", refuse)
    monkeypatch.setattr(sky_executor, "submit", refuse)


@settings(FUZZ, max_examples=200)
@given(args=command_lines())
def test_any_command_line_gives_a_result_or_one_line(tmp_path, monkeypatch, no_submission, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir(exist_ok=True)
    if not (skyspot_home() / "runs" / "run-1").exists():  # a run for status and cost-report to show
        make_run("run-1")
    result = invoke(*args)
    kind = outcome(result)
    if kind != "ok" or "--help" in args:
        return
    if args[0] in ("render", "launch") and "-o" not in args:
        assert_valid_task(result.stdout)
    if args[0] != "render" and "--json" in args and "--csv" not in args:
        assert isinstance(json.loads(result.stdout), list)


@pytest.mark.parametrize(
    "args, option, taken",
    [
        (["launch", "--store", "--dry-run", "tiny"], "--store", "--dry-run"),
        (["launch", "tiny", "-n", "--local"], "--name", "--local"),
        (["launch", "tiny", "--clouds", "--dry-run"], "--clouds", "--dry-run"),
        (["render", "tiny", "-o", "--help"], "--output", "--help"),
    ],
)
def test_an_option_given_another_option_as_its_value_is_a_missing_value(args, option, taken, tmp_path, monkeypatch):
    """Found by the fuzzer: `launch --store --dry-run tiny` read --dry-run as the store and launched for real."""
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert result.exit_code == 2
    assert f"option '{option}' needs a value, got the option '{taken}'" in result.output
    assert "Traceback" not in result.output and not Ledger().runs()
    assert [p.name for p in tmp_path.iterdir()] == ["skyspot-home"]  # nothing written where it ran


def test_valid_examples_parse_with_skypilot():
    """SkyPilot's own parser accepts what render prints, for each recipe and a few overrides."""
    sky = pytest.importorskip("sky")
    cases = [
        ["tiny"],
        ["llama8b", "resources.clouds=[aws, gcp]", "train.steps=7"],
        [
            "llama70b",
            "resources.regions=[us-east-1, us-central1]",
            "storage.store=s3://my-bucket/runs",
            "data.text_field=$(touch pwned); x",
        ],
        ["llama8b", "data.source=gs://my-data/train.jsonl", "resources.spot=false"],
    ]
    for args in cases:
        result = invoke("render", *args)
        assert outcome(result) == "ok", result.stderr
        task = assert_valid_task(result.stdout)
        parsed = sky.Task.from_yaml_config(copy.deepcopy(task))
        assert parsed.num_nodes == task["num_nodes"]


# --------------------------------------------------------------------------- escapes


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", ".", "..", "x\n", "Upper", "-x", "a" * 64, "", "a b", "x\x00"])
def test_a_run_name_that_could_escape_is_refused_before_anything_runs(no_submission, name):
    for args in (["launch", "tiny", "--dry-run", "-n", name], ["launch", "tiny", "--local", "-d", "-n", name]):
        result = invoke(*args)
        assert outcome(result) == "error" and "is not allowed" in result.stderr, result.stderr
        assert result.exit_code == 2


@pytest.mark.parametrize(
    "arg",
    [
        "../../etc/passwd-not-here",
        "/nonexistent/recipe.yaml",
        "recipes/../../x.yaml",
        "/dev/zero",
        "..",
        "/",
        "tiny/",
        "etc",
    ],
)
def test_a_recipe_argument_that_is_not_a_recipe_file_is_refused(tmp_path, monkeypatch, arg):
    monkeypatch.chdir(tmp_path)
    result = invoke("render", arg)
    assert outcome(result) == "error"
    assert re.search(r"not found|unknown recipe", result.stderr), result.stderr


def test_reading_a_system_file_as_a_recipe_echoes_none_of_it():
    result = invoke("render", "../../../../../../etc/passwd")
    assert outcome(result) == "error" and "root:" not in result.stderr


def test_a_registry_name_never_resolves_to_a_file_elsewhere(tmp_path, monkeypatch):
    """A planted `tiny` (or `tiny.yaml`, `recipes/tiny.yaml`) in the working directory changes nothing."""
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil.yaml"
    evil.write_text((RECIPES_DIR / "tiny.yaml").read_text().replace("steps: 200", "steps: 7"))
    (tmp_path / "recipes").mkdir()
    for link in ("tiny", "recipes/tiny.yaml", "skyspot"):
        (tmp_path / link).symlink_to(evil)
    result = invoke("render", "tiny")
    assert outcome(result) == "ok"
    from skyspot.task.package import PLACEHOLDER

    folder = yaml.safe_load(result.stdout)["file_mounts"]["/skyspot/package"]
    assert result.stdout.replace(folder, PLACEHOLDER) == (REPO / "tasks" / "tiny.yaml").read_text()
    for name in REGISTRY:
        path = recipe_path(name)
        assert path.parent == RECIPES_DIR and path.is_file() and not path.is_symlink()


@settings(FUZZ, max_examples=200)
@given(name=st.text(max_size=30))
def test_a_name_is_the_registry_or_a_path_never_a_guess(tmp_path, monkeypatch, name):
    """A name with no separator and no .yaml suffix resolves only through the registry."""
    assume(name not in REGISTRY and os.sep not in name and not name.endswith((".yaml", ".yml")))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="unknown recipe"):
        recipe_path(name)


# --------------------------------------------------------------------------- every command, every option, bounded
#
# Each case runs the real CLI in this process under tests/bounds.py: more than 2 s of CPU time, more
# than 500 MB of resident memory, or 20 s blocked (a FIFO, a lock) fails it. Each case gets its own
# SKYSPOT_HOME and working directory with: a finished run with events (run-1), a run whose controller
# died and whose PID now names a stranger (live-1), a cancelled run that can be resumed (cancelled-1),
# a spot trace, a FIFO and a directory where files are expected. Nothing ever starts a process: the
# local executor's `_start_controller` is replaced by one that records the run as SUCCEEDED (a
# controller that ended at once), and a cloud submission fails the test.

from tests.bounds import bounded  # noqa: E402

COMMANDS = [
    "render",
    "launch",
    "recipes",
    "ls",
    "keys",
    "cp",
    "status",
    "logs",
    "cancel",
    "resume",
    "cost-report",
    "prices",
    "spot-risk",
]
NUMBERS = [
    "0",
    "1",
    "-1",
    "-3",
    "0.001",
    "1e-9",
    "2",
    "30",
    "1e9",
    "1e300",
    "1e309",
    "inf",
    "-inf",
    "nan",
    "-0",
    "9" * 40,
    "abc",
    "",
    " 5 ",
    "1,2",
    "0x10",
    "1_000",
]
STEP_LISTS = ["15,40", "1", "0", "abc", "1,,2", ",", "1,-2", "3,3,3", "999999999999", "1e3", "2,1,2", "1" * 50, ""]
DEADLINES = [
    "1h",
    "36h",
    "90m",
    "2d",
    "1h30m",
    "30s",
    "0s",
    "-1h",
    "0",
    "3000000d",
    "1" + "0" * 400 + "d",
    "9999-12-31T23:59-12:00",
    "0001-01-01T00:00+14:00",
    "2020-01-01T00:00Z",
    "2099-01-01T00:00Z",
    "tomorrow",
    "",
    "1e308h",
    "nan",
    "inf",
    "1h1h",
    "P1D",
    "\x1b[2J",
]
TRACES = ["trace.yaml", "bad-trace.yaml", "fifo", "sub", "/nonexistent", "/dev/zero", "", "trace.yaml\x00"]
RUNS = ["run-1", "live-1", "cancelled-1", "nope", "", "../x", "run-1\x1b[2J"]
OUTPUTS = [
    "out.yaml",
    "out.png",
    "out.svg",
    "out.pdf",
    "out.txt",
    "out",
    "sub",
    "sub/out.png",
    "nodir/x.png",
    "",
    "fifo",
    "link.png",
    "existing.png",
    ".",
]
LAUNCH_VALUES = {
    "-n": ["my-run", "run-1", "Bad Name", "", "a" * 70],
    "--clouds": ["aws", "aws,gcp", "oracle", "", ","],
    "--store": ["s3://my-bucket/runs", "gs://b/p", "./relative-store", "/tmp", "", "ftp://x/y", "S3://b/x"],
    "--deadline": DEADLINES,
    "--preempt-every": NUMBERS,
    "--preempt-at-steps": STEP_LISTS,
    "--spot-trace": TRACES,
    "--notice": NUMBERS,
    "--grace": NUMBERS,
    "--provision-delay": NUMBERS,
    "--fallback-after": NUMBERS,
    "--spot-nodes": STEP_LISTS,
    "--simulate": ["aws", "gcp", "azure", "bogus", ""],
}
LAUNCH_FLAGS = ["-y", "-d", "--no-on-demand-fallback", "--local", "--cloud", "--fresh-node"]
# Overrides each valid alone, absurd together or with the flags above (huge step counts and step times
# with a deadline, a thousand nodes on one machine, checkpoints rarer than the run, ...).
EXTREME_OVERRIDES = [
    "train.steps=1",
    "train.steps=1000000000000",
    "train.steps=10000000",
    "resources.step_seconds_hint=1000000000000",
    "resources.step_seconds_hint=0.000001",
    "resources.step_seconds_hint=1",
    "resources.num_nodes=1024",
    "resources.min_nodes=1",
    "checkpoint.every_steps=1",
    "checkpoint.every_steps=1000000000000",
    "checkpoint.keep=1",
    "train.micro_batch_size=1048576",
    "train.seq_len=16777216",
    "train.grad_accum=100000",
    "checkpoint.every_seconds=auto",
    "checkpoint.every_seconds=0.001",
    "train.warmup_steps=1000000000",
    "resources.deadline_policy=greedy",
    "resources.spot=false",
    "resources.on_demand_fallback=false",
    "resources.cpu_ranks=64",
    "data.num_samples=1",
    "train.lr=1e300",
    "train.log_every=1000000000",
]
value_of = lambda option: st.sampled_from(LAUNCH_VALUES[option]) | arg_text  # noqa: E731
recipes_or_junk = (
    st.sampled_from(["tiny", "tiny", "llama8b", "llama70b", "trace.yaml", "sub", "fifo", "mine.yaml", "lama70b", ""])
    | arg_text
)


@st.composite
def any_command(draw):
    """A command line for any command, with any of its options and values; junk and absurd mixes included."""
    command = draw(st.sampled_from(COMMANDS))
    pick = lambda *choices: draw(st.lists(st.sampled_from(choices), max_size=len(choices), unique=True))  # noqa: E731
    extreme = lambda: draw(st.lists(st.sampled_from(EXTREME_OVERRIDES), max_size=3, unique=True))  # noqa: E731
    if command == "render":
        args = ["render", draw(recipes_or_junk), *extreme(), *draw(st.lists(overrides, max_size=1))]
        if draw(st.booleans()):
            args += ["-o", draw(st.sampled_from(OUTPUTS) | arg_text)]
        args += pick("--force")
    elif command == "launch":
        # --dry-run, or a local launch (whose controller never starts here); never a cloud submission.
        args = ["launch", draw(recipes_or_junk)]
        args += ["--dry-run"] if draw(st.booleans()) else ["--local", "-d"]
        for option in draw(st.lists(st.sampled_from(sorted(LAUNCH_VALUES)), max_size=5, unique=True)):
            args += [option, draw(value_of(option))]
        args += [f for f in pick(*LAUNCH_FLAGS) if f not in ("--cloud", "-y") or "--dry-run" in args]
        args += ["--", *extreme(), *draw(st.lists(overrides, max_size=1))]
    elif command in ("recipes", "ls"):
        args = [command, *pick("--json", "-v", "--verbose")]
    elif command == "keys":
        args = ["keys", *draw(st.lists(recipes_or_junk, max_size=1)), *pick("--json")]
    elif command == "cp":
        args = ["cp", draw(recipes_or_junk), draw(st.sampled_from(OUTPUTS + ["mine2.yaml", "sub", " "]) | arg_text)]
    elif command == "status":
        args = ["status", *pick("--json", "-a", "--all")]
    elif command == "logs":
        args = ["logs", *draw(st.lists(st.sampled_from(RUNS), max_size=1))]
        args += ["-f"] if draw(st.booleans()) and args[-1] not in ("logs", "live-1") else []
    elif command == "cancel":
        args = ["cancel", *draw(st.lists(st.sampled_from(RUNS), max_size=1)), *pick("-a", "--all", "-y")]
    elif command == "resume":
        args = ["resume", draw(st.sampled_from(RUNS) | arg_text), *pick("-y", "-d")]
        args += [] if "-d" in args else ["-d"] if draw(st.booleans()) else []
    elif command == "cost-report":
        args = ["cost-report", *draw(st.lists(st.sampled_from(RUNS), max_size=1)), *pick("--json", "--csv", "--force")]
        if draw(st.booleans()):
            args += ["--plot", draw(st.sampled_from(OUTPUTS) | arg_text)]
    elif command == "spot-risk":
        args = ["spot-risk"]
        for option in pick("--cloud", "--instance", "--region"):
            values = ["aws", "oracle", "p5.48xlarge", "Standard_ND96amsr_A100_v4", "nope", "us-east-1", "mars-1", ""]
            args += [option, draw(st.sampled_from(values) | arg_text)]
        args += pick("--json")
    else:
        args = [
            "prices",
            *draw(st.lists(st.sampled_from(["aws", "gcp", "azure", "oracle", ""]), max_size=1)),
            *draw(st.lists(st.sampled_from(["p4d.24xlarge", "g5.48xlarge", "nope", ""]), max_size=1)),
            *pick("--json"),
        ]
    if draw(st.integers(0, 5)) == 0:
        args.insert(draw(st.integers(1, len(args))), draw(junk_tokens))
    return args


def _stage(root: Path, stranger_pid: int) -> Path:
    """A fresh home and working directory for one case (see the section's comment); the working dir."""
    from dataclasses import asdict

    os.environ["SKYSPOT_HOME"] = str(root / "home")
    make_run("run-1")
    make_run("live-1", status="RUNNING")
    run_dir = make_run("cancelled-1", status="CANCELLED")
    (run_dir / "local.json").write_text(json.dumps(asdict(_spec_for_resume())))
    with Ledger() as ledger:
        ledger.set_controller("live-1", stranger_pid)
    cwd = root / "cwd"
    (cwd / "sub").mkdir(parents=True)
    (cwd / "trace.yaml").write_text("preemptions: [5, 10]\n")
    (cwd / "bad-trace.yaml").write_text("preemptions: [-1, x]\nbogus: 1\n")
    (cwd / "mine.yaml").write_text((RECIPES_DIR / "tiny.yaml").read_text())
    (cwd / "existing.png").write_text("precious")
    (cwd / "notes.txt").write_text("precious")
    (cwd / "link.png").symlink_to(cwd / "notes.txt")
    os.mkfifo(cwd / "fifo")
    return cwd


_SPEC = []


def _spec_for_resume():
    if not _SPEC:
        from skyspot.executors.local.executor import LocalOptions, make_spec
        from skyspot.app.launch import build

        _SPEC.append(make_spec(build("tiny"), "cancelled-1", LocalOptions()))
    return _SPEC[0]


def _tree(cwd: Path) -> dict[str, bytes | str]:
    """Every entry under the working dir: a file's bytes, else its kind."""
    found = {}
    for path in sorted(cwd.rglob("*")):
        key = str(path.relative_to(cwd))
        if path.is_symlink():
            found[key] = f"link to {os.readlink(path)}"
        elif path.is_file():
            found[key] = path.read_bytes()
        else:
            found[key] = "dir" if path.is_dir() else "other"
    return found


def _outputs(args: list[str]) -> set[str]:
    """The paths a command line may write under its working dir: its -o, --plot and cp destination."""
    named = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-o", "--output", "--plot")}
    if args[0] == "cp" and len(args) >= 3:
        named |= {args[2], f"{args[2].rstrip('/')}/{Path(args[1]).name}", f"{args[2].rstrip('/')}/{args[1]}.yaml"}
    return {os.path.normpath(n) for n in named if n.strip()}


@pytest.fixture(scope="module")
def stranger():
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def controllers_never_start(monkeypatch):
    """The local executor runs to the point of starting its controller; the controller 'ends at once'."""
    import skyspot.executors.local.executor as local
    import skyspot.executors.sky.sdk as sky_executor

    def ended_at_once(name, run_dir, ledger, **fields):
        ledger.set_finished(name, "SUCCEEDED", exit_code=0)

    def refuse(*args, **kwargs):
        raise AssertionError("a fuzzed command line reached a cloud submission")

    monkeypatch.setattr(local, "_start_controller", ended_at_once)
    monkeypatch.setattr(sky_executor, "submit", refuse)


BOUNDED_CASES: list[dict] = []


def run_bounded(args: list[str], tmp_path: Path, stranger) -> tuple[str, object]:
    """One case: staged, run within the bounds, checked (one line or a result, and nothing written
    under the working dir but the command's own outputs); its outcome and result."""
    import tempfile

    root = Path(tempfile.mkdtemp(dir=tmp_path))
    cwd = _stage(root, stranger.pid)
    before = _tree(cwd)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with bounded(args) as figures:
            result = invoke(*args)
    finally:
        os.chdir(old)
    BOUNDED_CASES.append({"args": args, **figures})
    kind = outcome(result)
    after = _tree(cwd)
    allowed = _outputs(args)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed <= allowed, (args, sorted(changed - allowed))
    assert not [k for k in after if k.endswith(".tmp")], "a temp file was left behind"
    assert stranger.poll() is None, "a stranger was signalled"
    return kind, result


@settings(FUZZ, max_examples=300)
@given(args=any_command())
def test_every_command_and_option_answers_within_bounds(tmp_path, stranger, controllers_never_start, args):
    kind, result = run_bounded(args, tmp_path, stranger)
    if kind == "ok" and "--json" in args and "--help" not in args and args[0] not in ("render", "launch", "cp"):
        assert isinstance(json.loads(result.stdout), (list, dict))


@settings(FUZZ, max_examples=120)
@given(
    recipe=st.sampled_from(sorted(REGISTRY)),
    deadline=st.sampled_from(DEADLINES),
    extra=st.lists(st.sampled_from(EXTREME_OVERRIDES), min_size=1, max_size=4, unique=True),
    local=st.booleans(),
)
def test_values_valid_alone_but_absurd_together_answer_within_bounds(
    tmp_path, stranger, controllers_never_start, recipe, deadline, extra, local
):
    """A deadline with huge step counts and step times, a thousand nodes, checkpoints rarer than the run:
    each value passes on its own; together they must still be answered (planned or refused) in bounds."""
    args = ["launch", recipe, "--dry-run", "--deadline", deadline, *(["--local"] if local else []), "--", *extra]
    run_bounded(args, tmp_path, stranger)


def test_the_fuzzed_command_lines_cover_every_command_and_option():
    """The strategy above is not allowed to fall behind the CLI: each command and option it has."""
    import click
    import typer.main

    app_commands = typer.main.get_command(app).commands
    assert set(COMMANDS) == set(app_commands)
    source = Path(__file__).read_text()
    section = source[source.index("def any_command(") : source.index("def _stage(")]
    covered = set(LAUNCH_VALUES) | set(LAUNCH_FLAGS)
    for name, command in app_commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                names = set(param.opts) | set(param.secondary_opts)
                assert names & covered or any(f'"{n}"' in section for n in names), (name, param.opts)


@pytest.fixture(scope="module", autouse=True)
def _bounded_figures():
    """With -s: how many bounded cases ran and the most CPU time and memory one took (docs/reliability.md)."""
    yield
    if BOUNDED_CASES:
        worst_cpu = max(BOUNDED_CASES, key=lambda c: c["cpu_s"])
        worst_mem = max(BOUNDED_CASES, key=lambda c: c["peak_mb"])
        print(
            f"\nbounded cases: {len(BOUNDED_CASES)}; most CPU {worst_cpu['cpu_s']:.2f} s ({worst_cpu['args']}); "
            f"most memory {worst_mem['peak_mb']:.0f} MB ({worst_mem['args']}); "
            f"longest wall {max(c['wall_s'] for c in BOUNDED_CASES):.2f} s"
        )
