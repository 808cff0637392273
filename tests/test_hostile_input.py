"""Hostile and unlucky input (issue 23 items 1-4, 7, 10-12 and two of 15): deadlines that would hang
the CLI or be missed in silence, overrides that would send a node to another store, stores on the
wrong machine, override keys and types the trainer would read otherwise, a scheme in capitals,
a relative SKYSPOT_HOME and a bucket data source on a local run.

Each test reproduces its item (it fails on the code before the fix) and pins the guarantee
docs/reliability.md ("Store consistency and deadlines") lists. SkyPilot's control plane is faked
only where a controller launches stages (tests/executors/sky/test_sky_deadline.py's seam).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from skyspot.planning import deadline as dl
from skyspot.cli.main import app
from skyspot.errors import RecipeError, UsageError
from skyspot.app.launch import build, plan_deadline
from skyspot.recipe import load_recipe
from tests.conftest import REPO

runner = CliRunner()
HOUR = 3600.0


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env, catch_exceptions=True)


def one_line_error(result, *needles: str) -> str:
    """The command refused with exit 2 and one `error: ...` line (no traceback), naming `needles`."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    assert result.exit_code == 2, (result.exit_code, result.stdout[-500:], result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def trainer_words(task: dict) -> list[str]:
    """The trainer's arguments on the task's run line, as bash would split them."""
    line = task["run"].split("-m skyspot.trainer ", 1)[1].replace("\\\n", " ")
    return shlex.split(line)


def as_the_trainer_reads_it(task: dict, environ=None):
    """The recipe the node's trainer resolves from its command line (trainer/loop.py: load_recipe)."""
    words = trainer_words(task)
    recipe_arg, overrides = words[0], [w for w in words[1:] if "=" in w and not w.startswith("$")]
    recipe_arg = (task.get("file_mounts") or {}).get(recipe_arg, recipe_arg)  # a recipe file: where it is mounted from
    return load_recipe(recipe_arg, overrides, environ=environ or {})


# --------------------------------------------------------------------------- 1: the check is bounded


def _limited(seconds: int = 30, gigabytes: float = 2.0):
    def limit():
        cap = int(gigabytes * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    return limit


@pytest.mark.parametrize("steps, hint", [(10**12, 10**12), (10**7, 1)])
def test_a_deadline_check_answers_at_once_whatever_the_steps(tmp_path, steps, hint):
    """Item 1: `launch --deadline 1h` with 10**12 steps ran 10 minutes to 22 GB (a tick-by-tick replay)."""
    env = {**os.environ, "SKYSPOT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyspot.cli.main",
            "launch",
            "tiny",
            "--dry-run",
            "--deadline",
            "1h",
            f"train.steps={steps}",
            f"resources.step_seconds_hint={hint}",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limited(),
    )
    assert done.returncode == 2 and "even all on-demand cannot make the deadline" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - started < 30


def test_feasibility_is_arithmetic_and_a_replay_is_bounded_by_its_ticks():
    check = dl.feasibility(now=0.0, deadline=HOUR, steps=10**12, step_seconds_hint=1e12, restart_seconds=900.0)
    assert not check.ok and check.needed_seconds == 900.0 + 1e24
    outcome = dl.simulate(
        dl.Job(steps=10**12, step_seconds=1e12, deadline=HOUR, restart_seconds=1.0), _NoLosses(), "adaptive"
    )
    assert len(outcome.decisions) <= dl.MAX_TICKS + 1 and not outcome.met


class _NoLosses:
    def losses(self):
        return []

    def available(self, t, preemptions=0):
        return True


# --------------------------------------------------------------------------- 7: deadlines out of range


@pytest.mark.parametrize(
    "given", ["3000000d", "9999-12-31T23:59-12:00", "0001-01-01T00:00+14:00", "9" * 400 + "d", "8000-01-01T00:00Z"]
)
def test_a_deadline_out_of_range_is_one_line_and_exit_2(given):
    """Item 7: these printed `year ... is out of range` tracebacks, or (400 digits) became infinity."""
    one_line_error(invoke("launch", "tiny", "--dry-run", "--deadline", given), "deadline")


def test_far_times_show_as_unknown_rather_than_raise():
    assert dl.when(1e24) == dl.clock(1e24) == "-"
    with pytest.raises(dl.DeadlineError, match="more than 3650 days"):
        dl.parse_deadline("9" * 400 + "d", now=0.0)


# --------------------------------------------------------------------------- 2: knowable before, said during


def test_a_deadline_shorter_than_the_start_up_is_refused_without_a_hint():
    """Item 2: 20 s for a 50,000-step run was accepted when no step time was known."""
    line = one_line_error(
        invoke("launch", "tiny", "--dry-run", "--deadline", "20s", "train.steps=50000"),
        "even all on-demand cannot make the deadline",
        "at least",
    )
    assert "50,000 steps" in line


def test_the_step_time_floor_refuses_what_no_accelerator_could_do():
    from skyspot.planning.step_prior import step_seconds_floor

    recipe = load_recipe("llama70b", environ={})
    floor, how = step_seconds_floor(recipe)
    assert 1.0 < floor < 60.0 and "70,553,706,496 parameters" in how  # H100's peak, 32k tokens per rank
    with pytest.raises(UsageError, match="at least"):
        plan_deadline(load_recipe("llama70b", ["resources.deadline=2h"], environ={}), local=False)
    plan = plan_deadline(load_recipe("llama70b", ["resources.deadline=30h"], environ={}), local=False)
    assert plan["step_seconds_prior"] == pytest.approx(floor)


def _state(**kw):
    base = dict(now=1000.0, start=0.0, deadline=2000.0, total_steps=1000, done_steps=100, mode=dl.SPOT)
    return dl.State(**{**base, **kw})


def test_a_deadline_that_cannot_be_met_any_more_is_said_and_run_on_demand():
    """Item 2: with the deadline gone the policy said `spot first (even when behind)`, projected_finish null."""
    unknown = dl.Estimates(
        step_seconds={dl.SPOT: None, dl.ON_DEMAND: None}, restart_seconds=30.0, restart_seconds_max=30.0
    )
    gone = dl.decide("adaptive", _state(now=2500.0, mode=dl.IDLE), unknown)
    assert (gone.mode, gone.reason, gone.committed) == (dl.ON_DEMAND, dl.UNREACHABLE, True)
    known = dl.Estimates(step_seconds={dl.SPOT: 2.0, dl.ON_DEMAND: 2.0}, restart_seconds=30.0, restart_seconds_max=30.0)
    late = dl.decide("adaptive", _state(), known)  # 900 steps x 2 s from t=1000 ends at 2800 > 2000
    assert late.reason == dl.UNREACHABLE and "cannot be met" in late.why
    assert dl.news(None, late, 2000.0).startswith("deadline UNREACHABLE: on-demand")
    row = dl.status_row(
        {"at": 2000.0, "policy": "adaptive"},
        [{"ts": 1.0, "type": dl.DECISION_EVENT, **late.event_fields(_state(), known)}],
        ended_at=None,
    )
    from skyspot.app.status import deadline_text

    assert row["unreachable"] is True and deadline_text(row).startswith("UNREACHABLE, on-demand to the end")


def test_before_any_step_the_policy_plans_with_the_floor_launch_recorded():
    estimates = dl.estimates_for([], {"step_seconds_prior": 0.5}, provision_seconds=2.0, restart_prior=32.0)
    assert estimates.step_seconds == {dl.SPOT: 0.5, dl.ON_DEMAND: 0.5} and "floor" in estimates.sources["step_seconds"]
    decision = dl.decide("adaptive", _state(done_steps=0, mode=dl.IDLE), estimates)
    assert decision.projected_finish is not None


def test_the_local_controller_says_an_unreachable_deadline_at_once(tmp_path):
    from skyspot.events import read_events_dir
    from skyspot.executors.local.deadline import Planner
    from tests.executors.local.test_local_deadline_planner import FakeController

    controller = FakeController(tmp_path, at=5, total_steps=100)  # 100 steps x 1 s (the hint) in 5 s: gone
    assert Planner(controller).choose() is False  # on-demand, to finish as soon as it can
    assert any(line.startswith("deadline UNREACHABLE") for line in controller.lines), controller.lines
    (decision,) = read_events_dir(tmp_path / "events").of_type(dl.DECISION_EVENT)
    assert (decision["reason"], decision["mode"], decision["committed"]) == (dl.UNREACHABLE, dl.ON_DEMAND, True)


def test_the_controller_on_skypilot_says_it_too_and_runs_on_demand(monkeypatch, tmp_path):
    from skyspot.events import read_events_store
    from skyspot.executors.sky import deadline as sky_deadline
    from skyspot.storage import open_store
    from tests.executors.sky.test_sky_deadline import Clock, FakeSkyPilot, _plan

    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    plan, start = _plan(tmp_path, hours=2)  # 100 steps x 300 s (the hint) = 8.3 h: gone from the start
    lines: list[str] = []
    controller = sky_deadline.CloudController(
        plan, store=open_store(plan["store"]), clock=Clock(start), sleep=lambda s: None, say=lines.append
    )
    assert controller.step() is None
    ((_, task, _),) = fake.launched
    assert {r.use_spot for r in task.resources} == {False}
    assert any(line.startswith("deadline UNREACHABLE") for line in lines), lines
    (decision,) = read_events_store(controller.store, "due").of_type(dl.DECISION_EVENT)
    assert decision["reason"] == dl.UNREACHABLE


# --------------------------------------------------------------------------- 3: one store, whatever sets it


STORE_A, STORE_B = "s3://bucket-a/pa", "s3://bucket-b/pb"


@pytest.mark.parametrize(
    "overrides, environ, flag, expected",
    [
        (["storage={store: %s}" % STORE_A], {}, STORE_B, STORE_B),  # the example
        ([f"storage.store={STORE_A}"], {}, STORE_B, STORE_B),
        (["storage={store: %s}" % STORE_A, f"storage.store={STORE_B}"], {}, None, STORE_B),
        ([f"storage.store={STORE_B}", "storage={store: %s}" % STORE_A], {}, None, STORE_A),  # the later word wins
        (["storage={store: %s}" % STORE_A], {"SKYSPOT_STORAGE__STORE": STORE_B}, None, STORE_A),
        ([], {"SKYSPOT_STORAGE__STORE": STORE_A}, STORE_B, STORE_B),
        ([], {"SKYSPOT_STORAGE__STORE": STORE_A}, None, STORE_A),
    ],
)
def test_the_recorded_store_the_mount_and_the_trainers_store_are_one_value(overrides, environ, flag, expected):
    """Item 3: `'storage={store: A}' --store B` mounted and recorded B while the trainer resolved A."""
    built = build("llama8b", overrides, flags={"storage.store": flag}, environ=environ, run_name="r1")
    assert built.recipe.storage.store == expected  # what record_launch writes to the ledger
    bucket = expected.split("/")[2]
    assert built.task["file_mounts"][f"/skyspot/store/{bucket}"]["source"] == f"s3://{bucket}"
    assert built.task["envs"]["SKYSPOT_STORE_MOUNT"].startswith(f"/skyspot/store/{bucket}/")
    assert as_the_trainer_reads_it(built.task, environ).storage.store == expected
    assert [w for w in trainer_words(built.task) if w.startswith("storage")] == [f"storage.store={expected}"]


def test_every_override_reaches_the_trainer_as_the_value_launch_resolved():
    built = build(
        "tiny",
        ["train={steps: 9, micro_batch_size: 2, lr: 0.5, seq_len: 32}", "train.steps=7"],
        environ={"SKYSPOT_TRAIN__LR": "0.25"},
    )
    node = as_the_trainer_reads_it(built.task)
    assert node.train == built.recipe.train and node.train.steps == 7
    assert sum(w.startswith("train") for w in trainer_words(built.task)) == 1  # the section, once


# --------------------------------------------------------------------------- 4: stores against where it runs


@pytest.mark.parametrize("store", ["./relative-store", "/tmp/abs-store", "file:///tmp/x", "~/ckpts"])
@pytest.mark.parametrize("dry", [True, False])
def test_a_cloud_launch_refuses_a_store_on_this_machine(store, dry, tmp_path, monkeypatch):
    """Item 4: `--store ./relative-store` was submitted, every checkpoint left on a VM."""
    monkeypatch.chdir(tmp_path)
    args = ["launch", "llama8b", "--store", store] + (["--dry-run"] if dry else ["-y"])
    one_line_error(invoke(*args), "is a directory on this machine", "--local")
    from skyspot.ledger import Ledger

    with Ledger() as ledger:
        assert ledger.runs(include_finished=True) == []


def test_relative_data_and_store_reach_a_local_run_absolute(tmp_path, monkeypatch):
    """Item 4: relative values reached the run script as typed; the local executor runs it in the run dir."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("hello world\n")
    built = build("tiny", ["storage.store=rel-store", "data.source=corpus.txt"], environ={}, local=True)
    words = trainer_words(built.task)
    assert f"storage.store={tmp_path / 'rel-store'}" in words and f"data.source={tmp_path / 'corpus.txt'}" in words
    monkeypatch.chdir(REPO)  # the trainer's own directory: it resolves the same files
    node = as_the_trainer_reads_it(built.task)
    assert (node.storage.store, node.data.source) == (str(tmp_path / "rel-store"), str(tmp_path / "corpus.txt"))


# --------------------------------------------------------------------------- 10, 11: keys and types


def test_an_environment_key_the_trainer_would_refuse_is_refused_at_launch():
    """Item 10: SKYSPOT_MODEL__CONFIG__A-B=1 passed launch (rc 0) and failed the paid run at its start."""
    env = {"SKYSPOT_MODEL__CONFIG__A-B": "1"}
    one_line_error(invoke("launch", "tiny", "--dry-run", env=env), "SKYSPOT_MODEL__CONFIG__A-B")
    with pytest.raises(UsageError, match="SKYSPOT_MODEL__CONFIG__A-B"):  # the trainer's parser, the same rule
        load_recipe("tiny", ["model.config.hidden_size=64"], environ=env)


@pytest.mark.parametrize(
    "override, read",
    [
        ("train.steps=true", "the boolean"),
        ("train.lr=true", "the boolean"),
        ("train.steps=5.0", "the number 5.0"),
        ('train.steps=" 5 "', "the string ' 5 '"),
        ("resources.spot=1", "the integer 1"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_coerced(override, read):
    """Item 11: `train.steps=true` was 1 step, `train.lr=true` 1.0, `5.0` and " 5 " passed."""
    one_line_error(invoke("launch", "tiny", "--dry-run", override), override, read)


def test_numbers_in_yaml_1_2_form_stay_numbers():
    recipe = load_recipe("tiny", ["train.lr=3e-4", "train.steps=1000"], environ={})
    assert (recipe.train.lr, recipe.train.steps) == (3e-4, 1000)
    # YAML 1.2's core schema has no digit separators: `1_000` is a string, which an integer key refuses.
    with pytest.raises(RecipeError):
        load_recipe("tiny", ["train.steps=1_000"], environ={})


def test_a_key_given_twice_in_a_recipe_file_is_an_error_with_its_line(tmp_path):
    """Item 11: a duplicate `name:` took the last value without a word."""
    text = (REPO / "skyspot" / "recipes" / "tiny.yaml").read_text()
    path = tmp_path / "twice.yaml"
    path.write_text(text + "name: other\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(str(path), environ={})
    line = len(text.splitlines()) + 1
    assert f"{path}:{line}" in str(error.value) and "duplicate key 'name'" in str(error.value)
    one_line_error(invoke("render", path), "duplicate key 'name'")
    with pytest.raises(UsageError, match="duplicate key 'store'"):  # an override's value reads the same way
        load_recipe("tiny", ["storage={store: /a, store: /b}"], environ={})


# --------------------------------------------------------------------------- 12: one decision on a scheme


def test_a_scheme_in_capitals_is_one_bucket_everywhere():
    """Item 12: `S3://bucket/x` passed the validator and render, and preflight called it a local file."""
    from skyspot.app.preflight import preflight
    from skyspot.storage import canonical, is_bucket_uri

    assert is_bucket_uri("S3://bucket/x") and canonical("S3://bucket/x/") == "s3://bucket/x"
    built = build(
        "llama8b", ["data.source=S3://my-data/sets/train.jsonl"], flags={"storage.store": "GS://ckpt-b/r"}, environ={}
    )
    assert (built.recipe.data.source, built.recipe.storage.store) == ("s3://my-data/sets/train.jsonl", "gs://ckpt-b/r")
    assert built.task["file_mounts"]["/skyspot/data/my-data"]["source"] == "s3://my-data"
    preflight(load_recipe("tiny", ["data.source=S3://my-data/sets/train.txt"], environ={}), local=False)  # no error


# --------------------------------------------------------------------------- 15: home and a local bucket source


def test_a_relative_skyspot_home_gives_absolute_mount_sources(tmp_path, monkeypatch):
    """Item 15: a relative SKYSPOT_HOME put a relative mount source (the wheel's folder) into the task."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SKYSPOT_HOME", "rel-home")
    from skyspot.ledger import skyspot_home

    assert skyspot_home() == tmp_path / "rel-home"
    result = invoke("launch", "llama8b", "--dry-run", "--store", STORE_A)
    assert result.exit_code == 0, result.stderr
    assert f"/skyspot/package: {tmp_path / 'rel-home'}/packages/" in result.stdout
    assert os.environ["SKYSPOT_HOME"] == str(tmp_path / "rel-home")  # what the processes it starts inherit


def test_a_local_run_reads_a_bucket_source_itself_not_through_a_cloud_mount(tmp_path):
    """Item 15: a local run with data.source=s3://... was handed /skyspot/data/..., which no local node has.
    Decided: the local task mounts no bucket; the trainer gets the URI and downloads it into its run
    directory first (trainer/resume.py `data_source`, data.py `resolve_source`)."""
    from skyspot.trainer.data import local_source_path

    source = "s3://my-data/sets/train.txt"
    built = build("tiny", [f"data.source={source}"], flags={"storage.store": STORE_A}, environ={}, local=True)
    assert list(built.task["file_mounts"]) == ["/skyspot/package"] and "SKYSPOT_STORE_MOUNT" not in built.task["envs"]
    assert not any("/skyspot/data" in w for w in trainer_words(built.task))
    node = as_the_trainer_reads_it(built.task)
    assert node.data.source == source
    assert local_source_path(node.data.source, tmp_path / "run" / "data") == str(
        tmp_path / "run" / "data" / "my-data" / "sets" / "train.txt"
    )
    cloud = build("tiny", [f"data.source={source}"], environ={})  # a cloud node still reads it through its mount
    assert "data.source=/skyspot/data/my-data/sets/train.txt" in trainer_words(cloud.task)


def test_decision_events_stay_json(tmp_path):
    """The unreachable decision's fields serialise (the local planner writes them as JSON lines)."""
    known = dl.Estimates(step_seconds={dl.SPOT: 2.0, dl.ON_DEMAND: 2.0}, restart_seconds=30.0, restart_seconds_max=30.0)
    fields = dl.decide("greedy", _state(), known).event_fields(_state(), known)
    assert json.loads(json.dumps(fields))["reason"] == dl.UNREACHABLE


# --------------------------------------------------------------------------- 3, property: any combination

STORES = ["s3://bucket-a/pa", "s3://bucket-b/pb", "gs://bucket-c/pc", "S3://bucket-d/pd/"]
SETTERS = st.lists(st.tuples(st.sampled_from(["section", "key"]), st.sampled_from([*STORES, "null"])), max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=SETTERS,
    env=st.none() | st.sampled_from(STORES),
    flag=st.none() | st.sampled_from(STORES),
    in_file=st.booleans(),
)
def test_any_combination_of_store_setters_gives_one_store(tmp_path_factory, words, env, flag, in_file):
    """Item 3, whatever the combination: flags > the command line's later word > environment > file
    (`null` unsets it: the file's store must not come back on the node)."""
    from skyspot.storage import canonical

    recipe = "llama8b"
    if in_file:
        recipe = str(tmp_path_factory.mktemp("r") / "with-store.yaml")
        text = (REPO / "skyspot" / "recipes" / "llama8b.yaml").read_text()
        open(recipe, "w").write(text.replace("storage:\n  store: null\n", "storage:\n  store: gs://file-store/f\n"))
    overrides = [("storage={store: %s}" if kind == "section" else "storage.store=%s") % store for kind, store in words]
    environ = {"SKYSPOT_STORAGE__STORE": env} if env else {}
    built = build(recipe, overrides, flags={"storage.store": flag}, environ=environ)
    winner = flag or (words[-1][1] if words else None) or env or ("gs://file-store/f" if in_file else None)
    expected = canonical(winner) if winner and winner != "null" else None
    assert built.recipe.storage.store == expected
    assert as_the_trainer_reads_it(built.task, environ).storage.store == expected
    mounts = [m["source"] for t, m in built.task["file_mounts"].items() if t.startswith("/skyspot/store/")]
    assert mounts == ([expected.rsplit("/", 1)[0]] if expected else [])


def test_an_iso_deadline_in_an_override_or_a_file_stays_text(tmp_path):
    """YAML 1.1 read `2030-05-01T17:00` as a datetime, which the strict string field would refuse."""
    assert (
        load_recipe("tiny", ["resources.deadline=2030-05-01T17:00+02:00"], environ={}).resources.deadline
        == "2030-05-01T17:00+02:00"
    )
    text = (
        (REPO / "skyspot" / "recipes" / "tiny.yaml")
        .read_text()
        .replace("resources:\n", "resources:\n  deadline: 2030-05-01\n", 1)
    )
    path = tmp_path / "dated.yaml"
    path.write_text(text)
    assert load_recipe(str(path), environ={}).resources.deadline == "2030-05-01"
