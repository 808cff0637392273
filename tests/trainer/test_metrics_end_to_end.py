"""The dashboards end to end: a local `tiny` run preempted twice, one preemption a SIGKILL that rolls
back past logged steps, read back with TensorBoard's, MLflow's and W&B's own readers from the store.

`launch tiny --local --simulate gcp`: GCP's SIGTERM comes with the notice, so the preemption read at
step 6 ends in an emergency checkpoint. At step 15 rank 0 is held for 8 s at the end of step 16, past
the simulated VM's hard off (notice + 3 s): SIGKILL, no emergency checkpoint, and the next attempt
resumes from step 12, redoing 13-16, which the dashboards already hold. Each backend must show one run
whose train-loss steps run 1..24 once each, and whose evaluations (every 4 steps on a held-out 5 %)
are each drawn once, all with an uninterrupted run's values (the module fixture: the same launch
without preemptions); the cost report gives the final eval loss beside the cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger

pytestmark = pytest.mark.slow
pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")
runner = CliRunner()

STEPS = 24
OVERRIDES = [
    f"train.steps={STEPS}",
    "checkpoint.every_steps=4",
    "train.log_every=8",
    "checkpoint.train_through_notice=false",
    "metrics.backends=[tensorboard,mlflow,wandb]",
    "eval.fraction=0.05",
    "eval.every_steps=4",
    "eval.batches=2",
]
SIGKILL_AT = 15  # the notice read at step 15; rank 0 held at the end of step 16 until the hard off
DASHBOARD_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_ERROR_REPORTING": "false",
    "MLFLOW_ALLOW_FILE_STORE": "true",
}


def launch(name: str, store: Path, *args: str) -> None:
    result = runner.invoke(
        app, ["launch", "tiny", "--local", "-n", name, "--store", str(store), *args, *OVERRIDES], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output


def train_losses(run_dir: Path) -> dict[int, float]:
    """Every step's loss as rank 0's events recorded it (a redone step has the same loss)."""
    return {e["step"]: e["loss"] for e in read_events_dir(run_dir / "events").of_type("step") if e.get("rank") == 0}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same launch without preemptions: the values every dashboard must show."""
    home = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SKYSPOT_HOME", str(home / "skyspot-home"))
        for key, value in DASHBOARD_ENV.items():
            mp.setenv(key, value)
        launch("calm", home / "store")
        run_dir = Path(Ledger().get("calm").run_dir)
        losses = train_losses(run_dir)
        evals = {e["step"]: e["loss"] for e in read_events_dir(run_dir / "events").of_type("eval")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert sorted(evals) == list(range(4, STEPS + 1, 4))
    return {"train/loss": losses, "eval/loss": evals}


def test_two_preemptions_one_a_sigkill_leave_one_run_per_dashboard_drawn_once(uninterrupted, tmp_path, monkeypatch):
    from tests.trainer.test_metrics import mlflow_series, tensorboard_series, wandb_series

    for key, value in DASHBOARD_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SKYSPOT_FAULT", f"step_end@{SIGKILL_AT + 1}/0:pause=8")
    store = tmp_path / "store"
    launch(
        "stormy",
        store,
        "--simulate",
        "gcp",
        "--notice",
        "3",
        "--provision-delay",
        "0.5",
        "--preempt-at-steps",
        f"6,{SIGKILL_AT}",
    )

    run_dir = Path(Ledger().get("stormy").run_dir)
    log = read_events_dir(run_dir / "events")
    resumes = [e["step"] for e in log.of_type("resume") if e.get("rank") == 0]
    assert len(resumes) == 2 and resumes[1] < SIGKILL_AT  # the SIGKILL rolled back past logged steps
    logged_twice = [s for s in range(resumes[1] + 1, SIGKILL_AT + 1)]
    assert sum(1 for e in log.of_type("step") if e.get("rank") == 0 and e["step"] in logged_twice) == 2 * len(
        logged_twice
    )

    kept = store / "stormy"  # what the store holds is what a dashboard over it shows
    tensorboard = tensorboard_series(kept / "tensorboard")
    mlflow_runs, mlflow = mlflow_series((kept / "mlruns").as_uri())
    wandb_ids, wandb = wandb_series(kept / "wandb")
    assert len(mlflow_runs) == 1 and wandb_ids == {"stormy"}
    for name, series in (("tensorboard", tensorboard), ("mlflow", mlflow), ("wandb", wandb)):
        for tag, expected in uninterrupted.items():
            steps = [s for s, _ in series[tag]]
            if name == "wandb" and tag == "eval/loss":
                # W&B's step is monotonic: an eval logged in an attempt's last row, which that attempt's
                # service did not write within a 3 s notice, cannot be sent again at its step later
                # (docs/trainer.md, "Metrics"). What it shows is drawn once, with the right values.
                assert steps == sorted(set(steps)) and set(steps) <= set(expected), f"{name} {tag}: {steps}"
                assert len(steps) >= len(expected) - 2, f"{name} {tag}: {steps}"
                assert dict(series[tag]) == pytest.approx({s: expected[s] for s in steps}, rel=1e-6, abs=0)
                continue
            assert steps == sorted(expected), f"{name} {tag}: {steps}"  # strictly increasing, none twice
            assert dict(series[tag]) == pytest.approx(expected, rel=1e-6, abs=0), f"{name} {tag}"
        assert dict(series["spot/preemptions"])[STEPS] == 2.0, name
        cost = [v for _, v in series["spot/cost_usd"]]
        assert cost == sorted(cost) and cost[-1] > 0, name
    evals = [e for e in log.of_type("eval")]
    assert sorted({e["step"] for e in evals}) == sorted(uninterrupted["eval/loss"])
    report = runner.invoke(app, ["cost-report", "stormy", "--json"], catch_exceptions=False)
    assert report.exit_code == 0, report.output
    (row,) = json.loads(report.stdout)
    assert row["final_eval_step"] == STEPS and row["final_eval_loss"] == uninterrupted["eval/loss"][STEPS]
