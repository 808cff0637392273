"""The way back to spot, make-before-break (issue 32; executors/local/return_to_spot.py).

The decision on its own; a run whose spot returns too late, with the stand-in nodes of
test_local_controller.py (a few lines of bash that log steps as the trainer does); and the whole cycle with
the real trainer: on-demand during an outage, a spot node made ready while it trains, the switch, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.planning.return_to_spot import switch_pays
from skyspot.ledger import Ledger

from tests.executors.local.test_local_controller import executor_attempts, nodes  # noqa: F401 (a fixture)

runner = CliRunner()
G5 = {"on_demand_usd_h": 16.288, "spot_usd_h": 4.5408}  # g5.48xlarge, us-east-1, the snapshot's


def test_the_switch_pays_when_the_rest_of_the_run_saves_more_than_the_restart_costs():
    hour = switch_pays(remaining_s=3600, provision_s=600, start_s=300, **G5)
    assert hour.pays and hour.gain_usd == pytest.approx(11.7472, abs=1e-3)
    assert hour.cost_usd == pytest.approx(900 * 4.5408 / 3600)
    late = switch_pays(remaining_s=60, provision_s=600, start_s=300, **G5)
    assert not late.pays
    assert late.why.startswith("60s of training left x ($16.29 - $4.54)/h = $0.1958, against $1.1352 for the spot")
    # Expected preemptions on spot make each restart count again: one every 5 minutes sinks an hour's switch.
    risky = switch_pays(remaining_s=3600, provision_s=600, start_s=300, rate_per_s=1 / 300, **G5)
    assert not risky.pays and "12.00 expected preemption(s)" in risky.why


def _steps(last_at: str) -> str:
    """A stand-in trainer: 3 s to its first step, steps 1-19 at once, step 20 when `last_at` (a file) exists."""
    events = '"$SKYSPOT_RUN_DIR/events/attempt-1.node-0.rank-0.jsonl"'
    line = '{\\"type\\":\\"step\\",\\"step\\":%s,\\"ts\\":%s,\\"run\\":\\"run-1\\",\\"attempt\\":1,\\"rank\\":0,\\"node_rank\\":0}'
    return "\n".join(
        [
            "sleep 3",
            f'for i in $(seq 1 19); do printf "{line}\\n" $i $(date +%s.%N) >> {events}; sleep 0.05; done',
            f"while [ ! -e {last_at} ]; do sleep 0.1; done",
            f'printf "{line}\\n" 20 $(date +%s.%N) >> {events}',
            "exit 0",
        ]
    )


def test_spot_back_with_one_step_left_does_not_pay_and_the_run_says_why(nodes, tmp_path):  # noqa: F811
    trace = tmp_path / "trace.yaml"
    trace.write_text("notice: 0\nunavailable: [[0, 6]]\n")  # spot back 6 s after launch, at step 19 of 20
    done = tmp_path / "outage-over"
    nodes["run"] = [f"{_steps(str(done))}"]
    import threading

    threading.Timer(9.0, done.touch).start()  # step 20 only once spot has been back a while
    result = runner.invoke(
        app,
        [
            "launch",
            "tiny",
            "--local",
            "-n",
            "run-1",
            "--provision-delay",
            "2",
            "--spot-trace",
            str(trace),
            "train.steps=20",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    assert [e["where"]["spot"] for e in executor_attempts() if e["type"] == "attempt_start"] == [False]
    log = Path(Ledger().get("run-1").run_dir, "logs", "run.log").read_text()
    said = next(line for line in log.splitlines() if "spot is back" in line)
    assert "spot is back, but the switch does not pay: " in said and said.endswith("; staying on on-demand")
    events = read_events_dir(Path(Ledger().get("run-1").run_dir) / "events")
    assert [e["decision"] for e in events.of_type("handover")] == ["declined"]


@pytest.mark.slow  # a real run of tiny through an outage and a switch: about a minute
def test_after_an_outage_the_run_returns_to_a_spot_node_made_ready_while_on_demand_trained(
    reference, monkeypatch, tmp_path
):
    """Issue 32, Done-when 2: the spot node is provisioned while on-demand trains, the on-demand attempt's last
    step comes after the spot node was ready, no step is trained twice, and the result is bitwise the
    uninterrupted run's."""
    from tests.executors.local.test_local_executor import OVERRIDES, STEPS, assert_same_params, final_params

    trace = tmp_path / "trace.yaml"
    trace.write_text("notice: 4\nunavailable: [[0, 20]]\n")
    # Each step at least 1.5 s (rank 0 pauses at its end): the run is still on on-demand when spot returns.
    monkeypatch.setenv("SKYSPOT_FAULT", "step_end/0:pause=1.5")  # every step (trainer/faults.py)
    result = runner.invoke(
        app,
        [
            "launch",
            "tiny",
            "--local",
            "-n",
            "back",
            "--provision-delay",
            "3",
            "--grace",
            "60",
            "--spot-trace",
            str(trace),
            *OVERRIDES,
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    run_dir = Path(Ledger().get("back").run_dir)
    log = read_events_dir(run_dir / "events")
    starts = log.of_type("attempt_start")
    assert [e["where"]["spot"] for e in starts] == [False, True]
    assert [e["reason"] for e in log.of_type("attempt_end")] == ["switched", "complete"]
    back = {e["decision"]: e for e in log.of_type("handover")}
    assert list(back) == ["provisioning", "ready"]
    assert back["ready"]["ts"] - back["provisioning"]["ts"] >= 3.0  # the provisioning delay
    on_demand = [e for e in log.of_type("step") if e.get("attempt") == 1 and e.get("rank") == 0]
    assert [e for e in on_demand if back["provisioning"]["ts"] < e["ts"] < back["ready"]["ts"]]  # trained meanwhile
    assert on_demand[-1]["ts"] >= back["ready"]["ts"] - 1.6  # the step in flight when the node was ready, or later
    # The spot attempt starts on the ready node (no second provisioning) and is billed from when it was ready.
    assert starts[1]["provisioned_at"] == pytest.approx(back["ready"]["ts"], abs=0.5)
    assert starts[1]["ts"] - on_demand[-1]["ts"] < 3.0 + 60
    # No step twice: the spot attempt resumes at the on-demand attempt's emergency checkpoint, its last step.
    emergency = next(e for e in log.of_type("emergency_checkpoint") if e.get("attempt") == 1 and e.get("rank") == 0)
    resumed = next(e for e in log.of_type("resume") if e.get("attempt") == 2 and e.get("rank") == 0)
    assert resumed["step"] == emergency["step"] == on_demand[-1]["step"]
    steps = [e["step"] for e in log.of_type("step") if e.get("rank") == 0]
    assert steps == list(range(1, STEPS + 1)), steps
    assert_same_params(final_params(run_dir), final_params(reference))
    report = json.loads(runner.invoke(app, ["cost-report", "back", "--json"]).stdout)[0]
    attempts = report["attempts"]
    assert [a["spot"] for a in attempts] == [False, True] and attempts[1]["start"] == pytest.approx(
        starts[1]["provisioned_at"]
    )
