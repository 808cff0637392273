"""The dashboards (trainer/metrics/) against their real libraries, read back with each one's own reader.

Each "attempt" is a real MetricsSink tapped into a real EventWriter, fed the events a trainer start
writes (start, resume, step, eval). TensorBoard writes into a tmp run dir and is read back with
TensorBoard's EventAccumulator; MLflow uses a file store in tmp and is read back with MlflowClient;
W&B runs offline (WANDB_MODE=offline) into tmp and is read back from its offline records with wandb's
datastore reader. Nothing here reaches a network but 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from skyspot.events import EventWriter
from skyspot.recipe import load_recipe
from skyspot.trainer.metrics import attach
from skyspot.trainer.metrics.spot import PRICES_ENV, hourly_price, story, where_text
from skyspot.trainer.uploader import _regular_files

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

RUN = "metrics-run"
WHERE = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.48xlarge",
    "spot": True,
    "num_nodes": 1,
    "simulated": True,
}
PRICES = [
    {"cloud": "aws", "region": "us-east-1", "instance_type": "g5.48xlarge", "spot": True, "usd_per_hour": 3.6},
    {"cloud": "aws", "region": "us-east-1", "instance_type": "g5.48xlarge", "spot": False, "usd_per_hour": 16.29},
]


def loss_at(step: int) -> float:
    """What a deterministic training logs at `step`, whichever attempt runs it."""
    return 2.0 / (1 + step) + 0.001 * step


@pytest.fixture
def dashboards(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # no report to W&B's Sentry: loopback only
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv(PRICES_ENV, json.dumps(PRICES))
    return tmp_path / "run"


def start(run_dir: Path, attempt: int, backends: str, *, said: list, extra=(), store=None):
    if attempt > 1:
        # Readers order a run's files by name, which carries the second a start opened them in (TensorBoard's
        # event files, W&B's offline-run folders): real attempts are never a second apart, these would be.
        time.sleep(1.0 - time.time() % 1.0 + 0.01)
    recipe = load_recipe("tiny", [f"metrics.backends=[{backends}]", "train.steps=20", *extra])
    events = EventWriter(run_dir, RUN, attempt, 0, 0)
    tier = uploader = None
    if store is not None:  # the trainer's view of the run's store (durable.StoreTier's two members used here)
        from skyspot.events import read_events_store
        from skyspot.trainer.uploader import Uploader

        tier = SimpleNamespace(store=store, read_events=lambda: read_events_store(store, RUN).events)
        uploader = Uploader(store, RUN, events, events_dir=run_dir / "events", events_every=0.2)
    run = SimpleNamespace(
        run_dir=run_dir, run_id=RUN, attempt=attempt, recipe=recipe, tier=tier, uploader=uploader, events=events
    )
    sink = attach(run, said.append, environ={PRICES_ENV: json.dumps(PRICES)})
    events.emit("start", where=dict(WHERE, spot=attempt != 3), world_size=2, total_steps=20, recipe="tiny", pid=1)
    return sink, events


def train(events, steps, *, resumed_from=None, evals=()):
    if resumed_from is not None:
        events.emit("resume", step=resumed_from, checkpoint="x", source="local", load_seconds=0.1, bytes=1)
    tokens = 64 * (steps[0] - 1)
    for step in steps:
        tokens += 64
        events.emit(
            "step",
            step=step,
            loss=loss_at(step),
            lr=1e-3,
            step_seconds=0.5,
            samples=step * 4,
            tokens=tokens,
            grad_norm=1.0 + step / 100,
        )
        if step in evals:
            events.emit(
                "eval",
                step=step,
                loss=loss_at(step) + 0.5,
                perplexity=math.exp(loss_at(step) + 0.5),
                tokens=100,
                batches=2,
                seconds=0.1,
            )


def two_attempts_with_a_rollback(run_dir: Path, backends: str) -> list[str]:
    """Attempt 1 logs steps 1-12 and is SIGKILLed (never closed); attempt 2 resumes from step 8's checkpoint,
    redoes 9-12 with the same values, logs to 20 and completes."""
    said: list[str] = []
    first, events = start(run_dir, 1, backends, said=said)
    train(events, range(1, 13), evals=(5, 10))
    _drain(first)
    _abandon(first)
    second, events = start(run_dir, 2, backends, said=said)
    train(events, range(9, 21), resumed_from=8, evals=(10, 15, 20))
    second.close(0)
    series = tensorboard_series(run_dir / "tensorboard") if "tensorboard" in backends else None
    assert series is None or [s for s, _ in series["spot/preemptions"]] == list(range(1, 21))
    return said


def _drain(sink, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not sink._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the item taken last is being written


def _abandon(sink):
    """A SIGKILL: the sink's thread stops where it is, nothing is closed. W&B's process, which a kill takes
    along, lives on in this one: its records are written out first, so that it cannot add them later,
    behind the next attempt (what a kill loses is the backfill test's case)."""
    for backend in sink._backends or []:
        if backend.impl.name == "wandb":
            backend.impl.run.finish(exit_code=137)
    sink._queue.put(("close", "killed"))
    sink._thread.join(10)


# --------------------------------------------------------------------------- readers


def tensorboard_series(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_series(uri: str) -> tuple[list, dict[str, list[tuple[int, float]]]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("skyspot")
    runs = client.search_runs([experiment.experiment_id])
    series = {}
    for key in runs[0].data.metrics if runs else ():
        series[key] = sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key))
    return runs, series


def wandb_series(directory: Path) -> tuple[set, dict[str, list[tuple[int, float]]]]:
    from skyspot.trainer.metrics.to_wandb import read_history

    ids = {p.name[len("run-") : -len(".wandb")] for p in directory.glob("offline-run-*/run-*.wandb")}
    series: dict[str, list[tuple[int, float]]] = {}
    for run_id in ids:
        for row in read_history(directory, run_id):
            for key, value in row.items():
                if not key.startswith("_"):
                    series.setdefault(key, []).append((row["_step"], value))
    return ids, series


def assert_drawn_once(series: dict[str, list[tuple[int, float]]], *, last: int = 20) -> None:
    steps = [s for s, _ in series["train/loss"]]
    assert steps == list(range(1, last + 1)), steps  # strictly increasing, none twice, none missing
    assert [v for _, v in series["train/loss"]] == pytest.approx([loss_at(s) for s in steps], rel=1e-6)
    assert [s for s, _ in series["eval/loss"]] == [5, 10, 15, 20]
    spot = [s for s, _ in series["spot/preemptions"]]
    assert spot == sorted(set(spot)) and set(spot) <= set(steps)  # every live step's (a backfilled one has none)


# --------------------------------------------------------------------------- one run, no step twice


def test_tensorboard_keeps_one_run_and_purges_what_a_rollback_redoes(dashboards):
    said = two_attempts_with_a_rollback(dashboards, "tensorboard")
    series = tensorboard_series(dashboards / "tensorboard")
    assert_drawn_once(series)
    assert len(list((dashboards / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per start, one run
    assert dict(series["spot/preemptions"])[20] == 1.0 and dict(series["spot/preemptions"])[8] == 0.0
    assert not [line for line in said if "unavailable" in line or "could not" in line]


def test_a_fresh_node_pulls_the_run_from_the_store_and_the_store_shows_it_whole(dashboards, tmp_path):
    import shutil

    from skyspot.storage import open_store

    store = open_store(str(tmp_path / "store"))
    said: list[str] = []
    first, events = start(dashboards, 1, "tensorboard,mlflow", said=said, store=store)
    train(events, range(1, 11), evals=(5, 10))
    first.close(75)
    first_uploader = first.uploader
    first_uploader.close(timeout=10)
    shutil.rmtree(dashboards)  # the next attempt runs on another machine: only the store has the run
    dashboards.mkdir()
    (dashboards / "run.json").write_bytes(store.get_bytes(f"{RUN}/run.json"))  # what restore_run_json does
    second, events = start(dashboards, 2, "tensorboard,mlflow", said=said, store=store)
    train(events, range(11, 21), resumed_from=10, evals=(15, 20))
    second.close(0)
    second.uploader.close(timeout=10)
    kept = tmp_path / "store" / RUN
    for series in (
        tensorboard_series(kept / "tensorboard"),
        tensorboard_series(dashboards / "tensorboard"),
        mlflow_series((kept / "mlruns").as_uri())[1],
    ):
        assert_drawn_once(series)
    assert len(mlflow_series((kept / "mlruns").as_uri())[0]) == 1
    assert dict(tensorboard_series(kept / "tensorboard")["spot/preemptions"])[20] == 1.0
    assert not [line for line in said if "unavailable" in line or "could not" in line]


def test_a_relative_mlflow_path_is_a_store_inside_the_run_kept_in_the_runs_store(dashboards, tmp_path):
    """Issue 31, item 13: a relative `metrics.mlflow_tracking_uri` resolved against wherever the trainer ran
    and was not kept. It is a file store inside the run's directory, uploaded under the same path in the run's
    store, and a fresh node pulls it back and goes on in the same MLflow run."""
    import shutil

    from skyspot.storage import open_store

    store = open_store(str(tmp_path / "store"))
    said: list[str] = []
    relative = ("metrics.mlflow_tracking_uri=./tracking/mine",)
    first, events = start(dashboards, 1, "mlflow", said=said, store=store, extra=relative)
    train(events, range(1, 11), evals=(5, 10))
    first.close(75)
    first.uploader.close(timeout=10)
    assert (dashboards / "tracking" / "mine").is_dir() and not (dashboards / "mlruns").exists()
    shutil.rmtree(dashboards)  # another machine: only the store has the run
    dashboards.mkdir()
    (dashboards / "run.json").write_bytes(store.get_bytes(f"{RUN}/run.json"))
    second, events = start(dashboards, 2, "mlflow", said=said, store=store, extra=relative)
    train(events, range(11, 21), resumed_from=10, evals=(15, 20))
    second.close(0)
    second.uploader.close(timeout=10)
    kept = tmp_path / "store" / RUN / "tracking" / "mine"
    runs, series = mlflow_series(kept.as_uri())
    assert len(runs) == 1  # one MLflow run across both attempts
    assert_drawn_once(series)
    assert not [line for line in said if "unavailable" in line or "could not" in line]


def test_mlflow_resumes_its_run_from_run_json_and_skips_the_points_it_holds(dashboards):
    said = two_attempts_with_a_rollback(dashboards, "mlflow")
    runs, series = mlflow_series((dashboards / "mlruns").as_uri())
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert json.loads((dashboards / "run.json").read_text())["mlflow_run_id"] == runs[0].info.run_id
    assert_drawn_once(series)
    assert runs[0].data.tags["skyspot.where.attempt-1"] == "aws us-east-1 (us-east-1a) g5.48xlarge spot (simulated)"
    # The store's copy holds files only (an object store keeps no empty folder), and reads the same.
    copy = dashboards.parent / "copy"
    for path, rel in _regular_files(dashboards / "mlruns"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes(path.read_bytes())
    assert mlflow_series(copy.as_uri())[1] == series
    assert not [line for line in said if "unavailable" in line or "could not" in line]


def test_mlflow_finds_its_run_by_tag_when_run_json_lost_the_id(dashboards):
    said: list[str] = []
    first, events = start(dashboards, 1, "mlflow", said=said)
    train(events, range(1, 6))
    first.close(75)
    (dashboards / "run.json").unlink()  # killed before run.json reached the store, on a fresh node
    second, events = start(dashboards, 2, "mlflow", said=said)
    train(events, range(4, 9), resumed_from=3)
    second.close(0)
    runs, series = mlflow_series((dashboards / "mlruns").as_uri())
    assert len(runs) == 1 and [s for s, _ in series["train/loss"]] == list(range(1, 9))


def test_points_a_killed_attempt_had_not_made_durable_are_sent_again_from_the_events(dashboards):
    """W&B's process buffers its records and dies with the node: what it had not written is sent again by
    the next attempt, from the run's events (written line by line), up to the resume point."""
    said: list[str] = []
    first, events = start(dashboards, 1, "mlflow", said=said)
    train(events, range(1, 13), evals=(5, 10))
    _drain(first)
    _abandon(first)
    for path in (dashboards / "mlruns").rglob("metrics/*/*"):  # the last 4 steps never reached the backend
        lines = path.read_text().splitlines()
        path.write_text("".join(line + "\n" for line in lines if int(line.split()[2]) <= 8))
    second, events = start(dashboards, 2, "mlflow", said=said)
    train(events, range(11, 21), resumed_from=10, evals=(15, 20))
    second.close(0)
    _, series = mlflow_series((dashboards / "mlruns").as_uri())
    assert_drawn_once(series)
    assert [s for s, _ in series["spot/preemptions"]] == list(range(1, 9)) + list(range(11, 21))


def test_wandb_offline_is_one_run_id_whose_steps_only_increase(dashboards):
    said = two_attempts_with_a_rollback(dashboards, "wandb")
    ids, series = wandb_series(dashboards / "wandb")
    assert ids == {RUN}  # every attempt under the run's name
    assert_drawn_once(series)
    assert [v for _, v in series["train/grad_norm"]] == pytest.approx([1.0 + s / 100 for s in range(1, 21)])
    assert not [line for line in said if "unavailable" in line or "could not" in line]


def test_the_spot_story_counts_preemptions_and_prices_each_attempt(dashboards):
    said: list[str] = []
    for attempt, steps, resumed in ((1, range(1, 6), None), (2, range(6, 11), 5), (3, range(11, 21), 10)):
        sink, events = start(dashboards, attempt, "tensorboard", said=said)
        train(events, steps, resumed_from=resumed)
        sink.close(0 if attempt == 3 else 75)
        if attempt < 3:
            events.emit("exit", code=75, reason="preempted: emergency checkpoint step_5 committed", step=5)
    series = tensorboard_series(dashboards / "tensorboard")
    preemptions = dict(series["spot/preemptions"])
    assert (preemptions[5], preemptions[10], preemptions[20]) == (0.0, 1.0, 2.0)
    cost = [v for _, v in series["spot/cost_usd"]]
    assert cost == sorted(cost) and cost[0] > 0  # money only accrues, across attempts too
    assert dict(series["spot/attempt"])[20] == 3.0


def test_training_scalars_every_n_steps_and_the_last_evaluations_whenever_they_come(dashboards):
    said: list[str] = []
    sink, events = start(dashboards, 1, "tensorboard", said=said, extra=["metrics.every_steps=6"])
    train(events, range(1, 21), evals=(5, 10))
    sink.close(0)
    series = tensorboard_series(dashboards / "tensorboard")
    assert [s for s, _ in series["train/loss"]] == [6, 12, 18, 20]  # and the last step
    assert [s for s, _ in series["eval/loss"]] == [5, 10]
    assert [v for _, v in series["train/tokens_per_second"]] == pytest.approx([64 / 0.5] * 4)


def test_prices_match_the_placement_and_where_reads_as_text():
    assert hourly_price(PRICES, WHERE) == 3.6
    assert hourly_price(PRICES, dict(WHERE, spot=False)) == 16.29
    assert hourly_price(PRICES, dict(WHERE, instance_type="p5.48xlarge")) is None
    assert hourly_price([dict(PRICES[0], region=None)], dict(WHERE, region="us-west-2")) == 3.6  # any region
    assert (
        where_text(dict(WHERE, spot=False, num_nodes=2))
        == "aws us-east-1 (us-east-1a) g5.48xlarge on-demand x2 (simulated)"
    )
    started = {"ts": 7200.0, "attempt": 2, "where": WHERE}
    earlier = [
        {"ts": 0.0, "attempt": 1, "type": "start", "where": WHERE},
        {"ts": 3600.0, "attempt": 1, "type": "exit", "reason": "preempted", "code": 75},
    ]
    told = story(started, earlier, PRICES)
    assert told.preemptions == 1 and told.scalars(9000.0)["spot/cost_usd"] == pytest.approx(3.6 + 3.6 / 2)
    assert "spot/cost_usd" not in story(started, earlier, []).scalars(9000.0)  # no price: no cost curve


# --------------------------------------------------------------------------- failures cost one line


def test_an_unreachable_mlflow_server_costs_one_warning_and_the_others_go_on(dashboards):
    from skyspot.ports import free_port

    said: list[str] = []
    sink, events = start(
        dashboards,
        1,
        "mlflow,tensorboard",
        said=said,
        extra=[f"metrics.mlflow_tracking_uri=http://127.0.0.1:{free_port()}"],
    )
    train(events, range(1, 21))
    sink.close(0)
    mlflow_lines = [line for line in said if line.startswith("metrics: mlflow")]
    assert len(mlflow_lines) == 1 and "unavailable" in mlflow_lines[0] and "Traceback" not in mlflow_lines[0]
    assert [s for s, _ in tensorboard_series(dashboards / "tensorboard")["train/loss"]] == list(range(1, 21))


def test_a_wandb_server_that_does_not_answer_costs_one_warning(dashboards, monkeypatch):
    from skyspot.ports import free_port

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    said: list[str] = []
    sink, events = start(dashboards, 1, "wandb,tensorboard", said=said)
    train(events, range(1, 11))
    sink.close(0)
    lines = [line for line in said if line.startswith("metrics: wandb")]
    assert len(lines) == 1 and "does not answer" in lines[0] and not sink._thread.is_alive()
    assert [s for s, _ in tensorboard_series(dashboards / "tensorboard")["train/loss"]] == list(range(1, 11))


def test_a_backend_not_installed_costs_one_warning(dashboards, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    said: list[str] = []
    sink, events = start(dashboards, 1, "wandb,tensorboard", said=said)
    train(events, range(1, 11))
    sink.close(0)
    lines = [line for line in said if line.startswith("metrics: wandb")]
    assert len(lines) == 1 and "not installed" in lines[0] and "skyspot[wandb]" in lines[0]


def test_a_backend_that_fails_mid_run_warns_once_not_per_step(dashboards):
    said: list[str] = []
    sink, events = start(dashboards, 1, "tensorboard", said=said)
    train(events, range(1, 3))
    _drain(sink)
    sink._backends[0].impl.writer.close()  # every later write fails, as a full or lost disk would make it
    sink._backends[0].impl.writer.add_scalar = _raise
    train(events, range(3, 21))
    sink.close(0)
    failures = [line for line in said if "could not take" in line]
    assert len(failures) == 1 and "step 3" in failures[0]


def _raise(*args, **kwargs):
    raise OSError(28, "No space left on device")


# --------------------------------------------------------------------------- secrets


def test_no_dashboard_secret_reaches_a_file_the_dashboards_write(dashboards, monkeypatch):
    canaries = {
        "WANDB_API_KEY": "CANARYwandbKey0123456789abcdef0123456789",
        "MLFLOW_TRACKING_TOKEN": "CANARYmlflowToken",
    }
    for name, value in canaries.items():
        monkeypatch.setenv(name, value)
    said = two_attempts_with_a_rollback(dashboards, "tensorboard,mlflow,wandb")
    files = [p for p in dashboards.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in files) and any("mlruns" in p.parts for p in files)
    for path in files:
        assert b"CANARY" not in path.read_bytes(), path
    assert not [line for line in said if "CANARY" in line]
