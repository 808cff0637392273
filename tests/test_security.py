"""Security: no secret from the environment reaches a task, the ledger or a report; recipe values
that reach the task's shell script stay inert text; YAML is loaded safely; the user's files are private.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.ledger import Ledger, skyspot_home
from skyspot.recipe import RECIPES_DIR, REGISTRY
from tests.cli.test_status_cost_cli import make_run
from tests.conftest import REPO

runner = CliRunner()

CANARIES = {
    "HF_TOKEN": "hf_CANARYhftoken0123456789abcdef",
    "HUGGING_FACE_HUB_TOKEN": "hf_CANARYhubtoken0123456789",
    "AWS_ACCESS_KEY_ID": "AKIACANARYKEYID0123",
    "AWS_SECRET_ACCESS_KEY": "CANARYawsSecretAccessKey0123456789",
    "AWS_SESSION_TOKEN": "CANARYawsSessionToken",
    "AZURE_CLIENT_SECRET": "CANARYazureClientSecret",
    "AZURE_STORAGE_KEY": "CANARYazureStorageKey0123456789==",
    "AZURE_STORAGE_CONNECTION_STRING": "AccountName=x;AccountKey=CANARYazureConnKey==",
    "AZURE_STORAGE_SAS_TOKEN": "sv=2024&sig=CANARYazureSas",
    "WANDB_API_KEY": "CANARYwandbApiKey0123456789abcdef01234567",
    "MLFLOW_TRACKING_TOKEN": "CANARYmlflowTrackingToken",
}
MARK = "CANARY"


@pytest.fixture
def canary_env(tmp_path, monkeypatch):
    """Fake secrets in the environment, as on a user's laptop; each contains MARK."""
    creds = tmp_path / "CANARY-gcp-credentials.json"
    creds.write_text(json.dumps({"type": "service_account", "private_key": "CANARYprivateKey"}))
    for name, value in CANARIES.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(creds))
    return creds


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def assert_no_canary(*texts):
    for text in texts:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        assert MARK not in text and "hf_CANARY" not in text and "AKIACANARY" not in text


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("recipe", sorted(REGISTRY))
def test_no_secret_reaches_a_rendered_task_or_a_dry_run(canary_env, tmp_path, recipe):
    rendered = invoke("render", recipe)
    target = tmp_path / "task.yaml"
    written = invoke("render", recipe, "-o", target)
    dry = invoke("launch", recipe, "--dry-run", "--store", "s3://my-bucket/runs")
    assert rendered.exit_code == written.exit_code == dry.exit_code == 0, dry.stderr
    assert_no_canary(rendered.stdout, rendered.stderr, target.read_text(), written.stderr, dry.stdout, dry.stderr)
    task = yaml.safe_load(dry.stdout)
    if recipe == "llama70b":  # gated: the token is named, its value is added in memory at submission
        assert task["secrets"] == {"HF_TOKEN": None, "SKYSPOT_WHEELHOUSE_KEY": None}
    assert not set(task["envs"]) & (set(CANARIES) | {"GOOGLE_APPLICATION_CREDENTIALS"})
    on_azure = invoke("launch", recipe, "--dry-run", "--store", "az://myacct/ckpts/runs")
    assert on_azure.exit_code == 0, on_azure.stderr
    assert_no_canary(on_azure.stdout, on_azure.stderr)
    assert yaml.safe_load(on_azure.stdout)["secrets"]["AZURE_STORAGE_KEY"] is None  # the nodes' key, by name only


def test_no_secret_reaches_the_ledger_the_local_spec_or_the_reports(canary_env):
    from skyspot.executors.local.executor import LocalOptions, make_spec
    from skyspot.app.launch import build
    from skyspot.ledger import record_launch

    built = build("llama8b", run_name="cloud-run")
    record_launch("cloud-run", built, "sky", info={"task": built.task})  # what `launch` records before submitting
    spec = make_spec(build("tiny"), "local-run", LocalOptions())  # what `launch --local` writes to local.json
    assert_no_canary(json.dumps(asdict(spec)))
    make_run("hand-built")

    status = invoke("status", "--json", "-a")
    reports = [
        invoke("cost-report", *args)
        for args in (["--json"], ["--csv"], [], ["hand-built", "--json"], ["hand-built", "--csv"], ["hand-built"])
    ]
    assert status.exit_code == 0 and {r["name"] for r in json.loads(status.stdout)} == {"cloud-run", "hand-built"}
    assert all(r.exit_code == 0 for r in reports), [r.stderr for r in reports]
    assert_no_canary(status.stdout, status.stderr, *(r.stdout + r.stderr for r in reports))
    for path in skyspot_home().glob("ledger.db*"):  # the database and its WAL
        assert_no_canary(path.read_bytes())


def test_a_local_launch_records_no_secret_and_keeps_its_run_dir_private(canary_env, monkeypatch, open_umask):
    """`launch --local -d` up to starting the controller (a stub here): ledger row, run dir, spec, logs."""
    import skyspot.executors.local.executor as local

    class NoController:
        pid = 2**22 + 7

        def __init__(self, argv, **kwargs):
            assert argv[-1] == "priv-run" and MARK not in json.dumps(argv)

    monkeypatch.setattr(local.subprocess, "Popen", NoController)
    result = invoke("launch", "tiny", "--local", "-d", "-n", "priv-run")
    assert result.exit_code == 0, result.stderr
    run_dir = skyspot_home() / "runs" / "priv-run"
    assert _mode(skyspot_home()) == 0o700 and _mode(run_dir.parent) == 0o700
    assert _mode(run_dir) == 0o700 and _mode(run_dir / "logs") == 0o700
    for path in [run_dir / "local.json", run_dir / "logs" / "controller.log", *skyspot_home().glob("ledger.db*")]:
        assert _mode(path) & 0o077 == 0, path
        assert_no_canary(path.read_bytes())
    assert_no_canary(result.stdout, result.stderr)


def test_the_dashboards_secrets_are_named_in_the_task_never_valued(canary_env):
    """metrics.backends: the keys reach SkyPilot as secrets (values added in memory at submission, as
    HF_TOKEN's); the dashboards' own files are checked for them in tests/trainer/test_metrics.py."""
    from skyspot.executors.sky.sdk import secrets_for

    dry = invoke("launch", "tiny", "--dry-run", "--store", "s3://my-bucket/runs", "metrics.backends=[wandb,mlflow]")
    assert dry.exit_code == 0, dry.stderr
    assert_no_canary(dry.stdout, dry.stderr)
    task = yaml.safe_load(dry.stdout)
    assert task["secrets"] == {"WANDB_API_KEY": None, "MLFLOW_TRACKING_TOKEN": None, "SKYSPOT_WHEELHOUSE_KEY": None}
    dashboards = {k: CANARIES[k] for k in ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN")}
    assert {k: v for k, v in secrets_for(task, "tiny").items() if k != "SKYSPOT_WHEELHOUSE_KEY"} == dashboards
    given = secrets_for(task, "tiny", {"WANDB_API_KEY": "k"})  # a server without a token: none sent
    assert set(given) == {"WANDB_API_KEY", "SKYSPOT_WHEELHOUSE_KEY"} and given["WANDB_API_KEY"] == "k"


def test_the_wheelhouse_key_reaches_the_nodes_as_a_secret_and_nothing_else_keeps_it(aws_env, canary_env, monkeypatch):
    # aws_env first (moto's EC2 holds Amazon's EFA image the launch resolves), so the canaries replace its keys.
    """The run's key (wheelhouse.py) is made on the launching machine at the first launch, kept in
    $SKYSPOT_HOME/keys/<run> (0600), sent to SkyPilot in memory as the task's secret, the same at resume,
    and found in no rendered task, ledger row, report or local spec."""
    from tests.executors.sky.test_sky_seam import FakeSkyJobs, launched

    fake = FakeSkyJobs(monkeypatch)
    result = invoke("launch", "llama70b", "-y", "-d", "-n", "keyed", "--store", "s3://my-bucket/runs")
    assert result.exit_code == 0, result.stderr
    ((task, name),) = launched(fake)
    key_file = skyspot_home() / "keys" / "keyed"
    key = key_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key) and _mode(key_file) == 0o600 and _mode(key_file.parent) == 0o700
    assert task.secrets["SKYSPOT_WHEELHOUSE_KEY"].get_secret_value() == key  # SkyPilot puts it in the nodes' env
    # What SkyPilot's SDK sends the controller: the value itself, not a managed-secret reference
    # (`secrets:NAME`, which the jobs controller would try, and fail, to resolve).
    assert task.to_yaml_config()["secrets"]["SKYSPOT_WHEELHOUSE_KEY"] == key
    recorded = Ledger().get("keyed").info["task"]
    assert recorded["secrets"]["SKYSPOT_WHEELHOUSE_KEY"] is None
    fake.records[:] = [{"job_id": 42, "status": "CANCELLED", "recovery_count": 0}]
    assert invoke("status", "--json", "-a").exit_code == 0
    resumed = invoke("resume", "keyed", "-y", "-d")
    assert resumed.exit_code == 0, resumed.stderr
    again = launched(fake)[-1][0].secrets["SKYSPOT_WHEELHOUSE_KEY"].get_secret_value()
    assert again == key  # the same key at resume: the run's wheelhouse still holds
    for text in [
        result.stdout,
        result.stderr,
        resumed.stdout,
        resumed.stderr,
        invoke("status", "--json", "-a").stdout,
        invoke("cost-report", "--json").stdout,
        invoke("render", "llama70b", "--store", "s3://b/r").stdout,
    ]:
        assert key not in text
    for path in skyspot_home().glob("ledger.db*"):
        assert key.encode() not in path.read_bytes()


def test_an_error_does_not_echo_the_environment(canary_env):
    result = invoke("render", "tiny", "model.hub_id=x/y", "train.steps=-1")
    assert result.exit_code == 2
    assert_no_canary(result.stdout, result.stderr)


# --------------------------------------------------------------------------- shell quoting

PAYLOADS = [
    "x; touch pwned",
    "$(touch pwned)",
    "`touch pwned`",
    "x && touch pwned",
    "x | touch pwned",
    "x || touch pwned",
    "'; touch pwned; '",
    '"; touch pwned; "',
    "${IFS}touch${IFS}pwned",
    "$((6*7))",
    "*",
    "~root",
    "!!",
    "a\\",
    "x > pwned",
    "x; rm -rf victim",
    "$HOME",
    "\\$(touch pwned)",
    " $(touch pwned) ",
    "--store=/tmp/x",
]

STUB = """#!{python}
import json, os, sys
with open(os.environ["ARGV_OUT"], "w") as handle:
    json.dump([os.path.basename(sys.argv[0])] + sys.argv[1:], handle)
"""


def run_the_run_script(script: str, envs: dict, tmp_path: Path) -> list[str]:
    """Run a task's `run` script under bash with a stub `python` (skyspot's venv's, SKYSPOT_PYTHON) that
    records its argv: the last call is the supervisor's, torchrun's command after it."""
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    for path in (bin_dir, work, work / "victim", tmp_path / "home"):
        path.mkdir(exist_ok=True)
    for name in ("python", "torchrun"):
        stub = bin_dir / name
        stub.write_text(STUB.format(python=sys.executable))
        stub.chmod(0o755)
    argv_out = tmp_path / "argv.json"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "ARGV_OUT": str(argv_out),
        "SKYSPOT_PYTHON": str(bin_dir / "python"),  # `run` starts skyspot's venv python by path
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_TASK_ID": "sky-managed-1",
        **{k: str(v) for k, v in envs.items()},
    }
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.rglob("pwned")) and (work / "victim").is_dir()
    return json.loads(argv_out.read_text())


def trainer_args(argv: list[str]) -> list[str]:
    """What follows `torchrun ... -m skyspot.trainer`: recipe, --run-dir DIR, [storage.store=STORE], overrides."""
    assert argv[:3] == ["python", "-m", "skyspot.trainer.supervise"] and "torch.distributed.run" in argv
    at = argv.index("skyspot.trainer")
    assert argv[at - 1] == "-m"
    return argv[at + 1 :]


def render_task(*args) -> dict:
    result = invoke("render", *args)
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_an_override_value_reaches_the_trainer_as_one_literal_argument(tmp_path, payload):
    overrides = [f"data.text_field={payload}", f"model.config.name={payload}"]
    task = render_task("tiny", *overrides)
    rest = trainer_args(run_the_run_script(task["run"], task["envs"], tmp_path))
    # A task rendered without a name runs under SkyPilot's task id (unique per job), never the recipe's name.
    assert rest[:3] == ["tiny", "--run-dir", str(tmp_path / "home" / "skyspot" / "runs" / "sky-managed-1")]
    assert rest[3:] == overrides


def test_recipe_file_values_reach_the_trainer_and_the_store_flag_as_literals(tmp_path):
    evil = "$(touch pwned)`touch pwned`;touch pwned"
    text = (RECIPES_DIR / "llama8b.yaml").read_text()
    text = text.replace("source: hf://yahma/alpaca-cleaned", f"source: 's3://my-data/{evil}/train.jsonl'")
    text = text.replace("name: llama8b", "name: evil-recipe")
    text = text.replace("description: ", f"description: {evil} ")
    # The file's own `storage:` section, replaced (a second one is a duplicate key, refused with its line).
    assert "storage:\n  store: null\n" in text
    text = text.replace("storage:\n  store: null\n", f"storage:\n  store: 's3://my-bucket/runs/{evil}'\n")
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(text)
    task = render_task(recipe, "train.steps=3", f"data.split={evil}")
    rest = trainer_args(run_the_run_script(task["run"], task["envs"], tmp_path))
    assert rest[3] == f"storage.store=s3://my-bucket/runs/{evil}"
    assert rest[4:] == ["train.steps=3", f"data.split={evil}", f"data.source=/skyspot/data/my-data/{evil}/train.jsonl"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=30))
def test_any_override_text_arrives_verbatim(tmp_path, value):
    override = f"model.config.note={value}"
    task = render_task("tiny", "--", override)
    assert trainer_args(run_the_run_script(task["run"], task["envs"], tmp_path))[3:] == [override]


def test_the_golden_tasks_pass_bash_syntax_check():
    for path in sorted((REPO / "tasks").glob("*.yaml")):
        task = yaml.safe_load(path.read_text())
        for key in ("setup", "run"):
            check = subprocess.run(["bash", "-n"], input=task[key], text=True, capture_output=True)
            assert check.returncode == 0, (path.name, key, check.stderr)


# --------------------------------------------------------------------------- safe loading

# Calls that run or unpickle what a file holds. A new use must be added here, with a reason, and
# documented (docs/reliability.md).
UNSAFE = re.compile(
    r"\byaml\.load\(|\bunsafe_load\b|yaml\.(Unsafe|Full)?Loader\b|\bpickle\b|\bmarshal\b|"
    r"\bshelve\b|\bdill\b|\beval\(|\bexec\(|shell\s*=\s*True|\bos\.system\(|\bos\.popen\(|"
    r"\btorch\.load\("
)
ALLOWED = {
    # DeepSpeed's and torch's checkpoint loading unpickles: only from the run's own store (trainer/).
    "torch.load(": re.compile(r"^skyspot/trainer/"),
    "pickle": re.compile(r"^skyspot/trainer/"),
}


def test_nothing_is_loaded_unsafely_or_run_through_a_shell():
    found = []
    for path in sorted((REPO / "skyspot").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for match in UNSAFE.finditer(code):
                allowed = ALLOWED.get(match.group(0))
                if not (allowed and allowed.match(relative)):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []


def test_a_python_tag_in_a_recipe_or_an_override_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tag = "!!python/object/apply:os.system ['touch pwned']"
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES_DIR / "tiny.yaml").read_text().replace("source: synthetic", f"source: {tag}"))
    assert invoke("render", recipe).exit_code == 2
    result = invoke("render", "tiny", f"model.config.x={tag}")
    assert result.exit_code == 0  # read as the plain string it is, and passed on quoted
    assert shlex.quote(f"model.config.x={tag}") in yaml.safe_load(result.stdout)["run"]
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------- private files


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    """Umask 000: the modes below must come from the code, not from a kind umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_ledger_and_home_are_private_whatever_the_umask(tmp_path, monkeypatch, open_umask):
    monkeypatch.setenv("SKYSPOT_HOME", str(tmp_path / "fresh" / "home"))
    ledger = Ledger()
    ledger.add("run-1", "tiny", "local", total_steps=1)
    ledger.set_status("run-1", "RUNNING")
    try:
        home = skyspot_home()
        assert _mode(home) == 0o700
        files = sorted(home.glob("ledger.db*"))
        assert [p.name for p in files][:1] == ["ledger.db"]
        for path in files:  # the database, its WAL and shared-memory index
            assert _mode(path) & 0o077 == 0, (path.name, oct(_mode(path)))
    finally:
        ledger.close()


def test_a_readable_ledger_is_made_private_again(tmp_path):
    Ledger().close()
    path = skyspot_home() / "ledger.db"
    path.chmod(0o644)
    Ledger().close()
    assert _mode(path) == 0o600


def test_run_directories_and_event_files_are_private(tmp_path, open_umask):
    from skyspot.events import EventWriter
    from skyspot.executors.local.executor import runs_dir

    runs = runs_dir()
    assert _mode(runs) == 0o700
    writer = EventWriter(runs / "r", "r", 0, 0, 0)
    writer.emit("step", step=1, loss=1.0, step_seconds=0.1)
    writer.close()
    assert _mode(runs / "r" / "events") == 0o700 and _mode(writer.path) == 0o600


def test_a_rendered_task_file_keeps_the_usual_mode(tmp_path):
    target = tmp_path / "task.yaml"
    target.write_text("old")
    target.chmod(0o640)
    assert invoke("render", "tiny", "-o", target, "--force").exit_code == 0
    assert _mode(target) == 0o640 and "skyspot-tiny" in target.read_text()


def test_render_does_not_follow_a_planted_temp_file_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "task.yaml"
    (tmp_path / "task.yaml.tmp").symlink_to(victim)  # where the old code wrote its temp file
    assert invoke("render", "tiny", "-o", target).exit_code == 0
    assert victim.read_text() == "precious" and yaml.safe_load(target.read_text())["name"] == "skyspot-tiny"
