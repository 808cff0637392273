"""The rendered SkyPilot task: golden files, and SkyPilot's own parser reading it back.

`UPDATE_GOLDEN=1 pytest tests/task/test_task.py` rewrites tasks/*.yaml after an intended change.
"""

from __future__ import annotations

import copy
import os
import shlex
import sys

import pytest

from skyspot.app.launch import build
from skyspot.planning.candidates import dropped
from skyspot.recipe import REGISTRY
from tests.conftest import REPO

TASKS = REPO / "tasks"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rendered_task_matches_golden_file(name):
    rendered = build(name, environ={}).yaml
    golden = TASKS / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.read_text() == rendered, f"tasks/{name}.yaml drifted; rerun with UPDATE_GOLDEN=1 if intended"


def test_every_file_in_tasks_is_a_registry_recipe():
    assert sorted(p.stem for p in TASKS.glob("*.yaml")) == sorted(REGISTRY)


@pytest.fixture(scope="module")
def sky():
    import sky as sky_module

    return sky_module


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_golden_task_parses_with_skypilot(sky, name):
    task = sky.Task.from_yaml(str(TASKS / f"{name}.yaml"))
    recipe = build(name, environ={}).recipe
    res = recipe.resources
    resources = list(task.resources)
    per_mode = max(1, len(res.accelerators)) * len(res.clouds) - len(dropped(recipe))
    assert task.num_nodes == res.num_nodes
    assert len(resources) == 2 * per_mode  # spot + on-demand fallback
    assert sum(r.use_spot for r in resources) == per_mode
    # spot candidates come before every on-demand one
    assert [r.use_spot for r in resources] == [True] * per_mode + [False] * per_mode
    for r in resources:
        assert r.job_recovery == {
            "strategy": "EAGER_NEXT_REGION",
            "max_restarts_on_errors": 3,
            "recover_on_exit_codes": [75],
        }
    assert (
        '-m torch.distributed.run --nnodes "$SKYPILOT_NUM_NODES" --nproc_per_node "$NPROC" --max-restarts 72'
        in task.run
    )
    assert "--rdzv_backend c10d" in task.run and "is_host=$IS_HOST" in task.run
    assert 'exec "$PY" -m skyspot.trainer.supervise' in task.run


def test_a_multi_node_recipe_asks_skypilot_for_the_fast_fabric_where_its_cloud_has_one(sky):
    """llama70b: `network_tier: best` on every AWS candidate (EFA) and GCP H100:8 (GPUDirect-TCPX), on no
    Azure one (SkyPilot has no network_tier there) nor GCP A100 (no TCPX NICs on a2)."""
    task = sky.Task.from_yaml(str(TASKS / "llama70b.yaml"))
    tiers = {
        (
            str(r.cloud),
            f"{next(iter(r.accelerators))}:{next(iter(r.accelerators.values()))}",
            r.use_spot,
        ): r.network_tier.value if r.network_tier else None
        for r in task.resources
    }
    assert len(tiers) == 12
    for (cloud, accelerators, _), tier in tiers.items():
        want = "best" if cloud == "AWS" or (cloud == "GCP" and accelerators == "H100:8") else None
        assert tier == want, (cloud, accelerators)
    single = sky.Task.from_yaml(str(TASKS / "llama8b.yaml"))
    assert all(r.network_tier is None for r in single.resources)  # one node: nothing crosses a fabric


def test_a_pair_the_cloud_does_not_offer_is_no_candidate():
    built = build("smollm2-360m", environ={})
    pairs = {(c.cloud, c.accelerators) for c in built.candidates}
    assert pairs == {("aws", "L4:1"), ("gcp", "L4:1"), ("aws", "A10G:1")}
    assert dropped(built.recipe) == [
        ("gcp", "A10G:1", "gcp offers no A10G:1 instance (the price snapshot lists it on aws only)")
    ]
    assert all(c.usd_per_hour is not None for c in built.candidates)  # every candidate priced


def test_the_store_is_mounted_for_the_base_model_copy_and_written_through_the_sdk(sky):
    built = build("llama70b", flags={"storage.store": "gs://my-ckpts/team"}, environ={})
    task = sky.Task.from_yaml_config(copy.deepcopy(built.task))  # SkyPilot consumes the dict
    assert built.task["file_mounts"]["/skyspot/store/my-ckpts"] == {"source": "gs://my-ckpts", "mode": "MOUNT"}
    assert task.storage_mounts["/skyspot/store/my-ckpts"].mode.value == "MOUNT"
    # The trainer reads <store>/<run id>/base/ there; checkpoints go through the SDK (storage.store).
    assert built.task["envs"]["SKYSPOT_STORE_MOUNT"] == "/skyspot/store/my-ckpts/team"
    assert "storage.store=gs://my-ckpts/team" in built.task["run"]


def test_a_bucket_store_is_mounted_for_the_wheelhouse_and_setup_is_told_the_store():
    built = build("tiny", flags={"storage.store": "s3://my-ckpts/team"}, environ={})
    assert list(built.task["file_mounts"]) == ["/skyspot/package", "/skyspot/store/my-ckpts"]
    assert built.task["envs"]["SKYSPOT_STORE_MOUNT"] == "/skyspot/store/my-ckpts/team"  # setup reads it there
    assert '"$BOOT" -m skyspot.node_env setup --wheel "$WHEEL" --store s3://my-ckpts/team\n' in built.task["setup"]


def test_a_local_store_mounts_nothing():
    built = build("tiny", flags={"storage.store": "/tmp/skyspot-store"}, environ={})
    assert list(built.task["file_mounts"]) == ["/skyspot/package"]
    assert "SKYSPOT_STORE_MOUNT" not in built.task["envs"]


def test_a_bucket_data_source_is_mounted_in_mount_mode_and_read_there(sky):
    built = build("llama8b", ["data.source=s3://my-data/sets/train.jsonl"], environ={})
    task = sky.Task.from_yaml_config(copy.deepcopy(built.task))
    assert built.task["file_mounts"]["/skyspot/data/my-data"] == {"source": "s3://my-data", "mode": "MOUNT"}
    assert task.storage_mounts["/skyspot/data/my-data"].mode.value == "MOUNT"
    assert "data.source=/skyspot/data/my-data/sets/train.jsonl" in built.task["run"]


def test_a_bucket_eval_file_is_mounted_like_the_source_and_a_hub_split_goes_as_it_is(sky):
    built = build(
        "llama8b",
        ["data.source=s3://my-data/sets/train.jsonl", "data.eval_split=gs://held-data/v.jsonl", "eval.fraction=null"],
        environ={},
    )
    assert built.task["file_mounts"]["/skyspot/data/held-data"] == {"source": "gs://held-data", "mode": "MOUNT"}
    assert "data.eval_split=/skyspot/data/held-data/v.jsonl" in built.task["run"]
    sky.Task.from_yaml_config(copy.deepcopy(built.task))
    hub = build("llama8b", ["data.eval_split=validation", "eval.fraction=null"], environ={}).task
    assert not any(m.startswith("/skyspot/data") for m in hub["file_mounts"]) and "data.eval_split" in hub["run"]


def test_a_launched_task_names_the_run_and_mounts_the_wheel_it_was_built_with(tmp_path, sky):
    from skyspot.task import package as packaging

    package = packaging.build(tmp_path / "packages")
    built = build(
        "llama70b", flags={"storage.store": "s3://my-ckpts/team"}, environ={}, run_name="big-run", package=package
    )
    assert built.task["name"] == built.task["envs"]["SKYSPOT_RUN_NAME"] == "big-run"
    assert built.task["file_mounts"]["/skyspot/package"] == str(package.folder)
    assert [p.name for p in package.folder.iterdir()] == [package.wheel.name]  # setup installs skyspot-*.whl
    task = sky.Task.from_yaml_config(copy.deepcopy(built.task))
    task.expand_and_validate_file_mounts()  # what SkyPilot's client does before it uploads the mounts
    assert task.file_mounts["/skyspot/package"] == str(package.folder)


def test_an_unnamed_render_leaves_the_run_name_to_skypilots_task_id():
    task = build("llama70b", environ={}).task
    assert "SKYSPOT_RUN_NAME" not in task["envs"]
    assert 'SKYSPOT_RUN_NAME="${SKYSPOT_RUN_NAME:-$SKYPILOT_TASK_ID}"' in task["run"]


def test_setup_puts_the_run_directories_on_local_nvme_where_the_run_keeps_them(tmp_path):
    """setup's fast-tier step links the very directory `run` keeps run directories in, and cannot fail setup."""
    import subprocess

    task = build("llama70b", environ={}).task
    [line] = [line for line in task["setup"].splitlines() if "skyspot.trainer.local_disk" in line]
    assert line.endswith("|| true")
    runs_dir = shlex.split(line.replace("|| true", ""))[-1]
    assert f'RUN_DIR="${{SKYSPOT_RUN_DIR:-{runs_dir}/$SKYSPOT_RUN_NAME}}"' in task["run"]
    # Off a SkyPilot node (this machine) it changes nothing and says so.
    env = {**os.environ, "HOME": str(tmp_path), "PY": sys.executable}  # $PY: what setup's lines before it set
    env.pop("SKYPILOT_CLUSTER_INFO", None)
    done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "nothing changed" in done.stdout + done.stderr
    assert not (tmp_path / "skyspot").exists()


def test_gated_model_declares_hf_token_secret_without_value(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_canary_secret_value")
    built = build("llama70b", environ=dict(os.environ))
    assert built.task["secrets"] == {"HF_TOKEN": None}
    assert "hf_canary_secret_value" not in built.yaml


def test_regions_restrict_candidates_to_their_clouds(sky):
    built = build("llama8b", ["resources.regions=us-east-1,us-central1"], environ={})
    entries = built.task["resources"]["ordered"]
    assert {(e["cloud"], e["region"]) for e in entries} == {("aws", "us-east-1"), ("gcp", "us-central1")}
    assert len(list(sky.Task.from_yaml_config(copy.deepcopy(built.task)).resources)) == 8


def test_no_on_demand_fallback_renders_spot_only(sky):
    built = build("llama8b", flags={"resources.on_demand_fallback": False}, environ={})
    assert all(e["use_spot"] for e in built.task["resources"]["ordered"])


def test_override_values_reach_the_node_shell_quoted():
    evil = "$(touch pwned); rm -rf /"
    built = build("tiny", [f"data.text_field={evil}"], environ={})
    assert shlex.quote(f"data.text_field={evil}") in built.task["run"]
    # bash parses the trainer line with the value as one inert word
    words = shlex.split(built.task["run"].split("-m skyspot.trainer ", 1)[1].replace("\\\n", " "))
    assert f"data.text_field={evil}" in words


def test_trainer_overrides_come_from_env_and_cli_with_cli_winning():
    built = build("tiny", ["train.steps=7"], environ={"SKYSPOT_TRAIN__STEPS": "9", "SKYSPOT_TRAIN__LR": "0.01"})
    assert built.recipe.train.steps == 7
    assert "train.steps=7" in built.trainer_overrides and "train.lr=0.01" in built.trainer_overrides
    assert "train.steps=9" not in built.trainer_overrides


def test_every_value_set_at_launch_reaches_the_node_as_an_override_the_store_first():
    built = build(
        "tiny",
        ["train.steps=7"],
        flags={"storage.store": "s3://my-ckpts/team", "resources.clouds": ["aws"]},
        environ={"SKYSPOT_TRAIN__LR": "0.01", "SKYSPOT_RESOURCES__SPOT": "false", "HF_TOKEN": "hf_x"},
    )
    words = shlex.split(built.task["run"].split("-m skyspot.trainer ", 1)[1].replace("\\\n", " "))
    assert words == [
        "tiny",
        "--run-dir",
        "$RUN_DIR",
        "storage.store=s3://my-ckpts/team",
        "train.lr=0.01",
        "train.steps=7",
    ]
    # No value rides in an environment variable (SKYSPOT_STORE_MOUNT is where the bucket is mounted, not a value).
    assert not any(name.startswith(("SKYSPOT_STORAGE", "SKYSPOT_TRAIN")) for name in built.task["envs"])


def test_a_build_plans_once_and_a_launch_builds_once(monkeypatch):
    import skyspot.app.launch
    from typer.testing import CliRunner

    from skyspot.cli.main import app

    calls = {"candidates": 0, "build": 0}
    plan, make = skyspot.app.launch.candidates, skyspot.app.launch.build

    def counted_plan(*args, **kwargs):
        calls["candidates"] += 1
        return plan(*args, **kwargs)

    def counted_build(*args, **kwargs):
        calls["build"] += 1
        return make(*args, **kwargs)

    monkeypatch.setattr(skyspot.app.launch, "candidates", counted_plan)
    monkeypatch.setattr(skyspot.app.launch, "build", counted_build)
    result = CliRunner().invoke(app, ["launch", "llama70b", "--dry-run", "--store", "s3://my-ckpts/team"])
    assert result.exit_code == 0, result.output
    assert calls == {"candidates": 1, "build": 1}


def _tcpx_lines(script: str) -> str:
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('TCPX="'))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "fi")
    return "\n".join(lines[start : end + 1])


def test_setup_waits_for_tcpx_in_a_bound_and_loads_the_plugin_beside_torchs_own_nccl(tmp_path):
    """The TCPX container's folders, under a root the test makes (SKYSPOT_TCPX_ROOT): a plugin install that
    never finishes fails setup in one line with exit 2; a finished one gives `run` an LD_LIBRARY_PATH with
    the plugin's files but not the installer's libnccl.so.2, and the driver's folder kept."""
    import subprocess

    task = build("llama70b", environ={}).task
    block = _tcpx_lines(task["setup"])
    root, home = tmp_path / "usr-local", tmp_path / "home"
    (root / "tcpx" / "lib64").mkdir(parents=True)
    (root / "nvidia" / "lib64").mkdir(parents=True)
    (root / "nvidia" / "lib64" / "libcuda.so.1").write_bytes(b"")  # the host's driver, mounted in
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "SKYSPOT_TCPX_ROOT": str(root),
        "SKYSPOT_TCPX_WAIT_SECONDS": "0",
    }
    stuck = subprocess.run(["bash", "-ec", block], env=env, capture_output=True, text=True, timeout=60)
    assert stuck.returncode == 2 and stuck.stderr.count("\n") == 1, stuck.stderr
    assert "GPUDirect-TCPX is not installed on this node after 0s" in stuck.stderr

    for name in ("libnccl.so.2", "libnccl.so.2.18.5", "libnccl-net.so"):
        (root / "tcpx" / "lib64" / name).write_bytes(b"")
    ready = subprocess.run(["bash", "-ec", block], env=env, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 0, ready.stderr
    shim = home / ".skyspot" / "tcpx-lib"
    assert sorted(p.name for p in shim.iterdir()) == ["libnccl-net.so"]
    # what `run` exports: the container's LD_LIBRARY_PATH, cleaned, with the shim first
    lines = task["run"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PY="))
    exported = "\n".join(lines[start : start + 3]) + '\necho "$LD_LIBRARY_PATH"'
    container = {**env, "SKYSPOT_PYTHON": sys.executable, "LD_LIBRARY_PATH": f"{root}/nvidia/lib64:{root}/tcpx/lib64"}
    done = subprocess.run(["bash", "-ec", exported], env=container, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"{shim}:{root}/nvidia/lib64", done.stdout + done.stderr


def test_hang_bounds_reach_the_supervisor_exactly():
    """`:g` wrote 1234567 as 1.23457e+06 (issue 31, item 13): the supervisor got another bound than the recipe's."""
    from skyspot.recipe import load_recipe
    from skyspot.task.render import run_script

    script = run_script(
        load_recipe("tiny", ["resilience.hang_floor_seconds=1234567", "resilience.hang_factor=2.5"]), "tiny", []
    )
    assert "--hang-factor 2.5 --hang-floor 1234567 " in script and "e+" not in script
