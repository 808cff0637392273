"""Make-before-break in a deadline's switches (issue 32; executors/local/handover.py), with the stand-in nodes of
test_local_controller.py (a few lines of bash that log steps as the trainer does, and exit 75 on SIGTERM as
the trainer does after its emergency checkpoint) and the real controller, planner and trace.

The way back to spot without a deadline goes through the same handover: test_return_to_spot.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger
from skyspot.planning.deadline import DECISION_EVENT

from tests.executors.local.test_local_controller import nodes  # noqa: F401 (a fixture)

runner = CliRunner()
PROVISION_S = 2.0


def _stand_in(first: int, last: int, counter: Path) -> str:
    """Steps `first`..`last`, 0.3 s apart, as the trainer logs them; on SIGTERM exit 75 (preempted, saved)."""
    events = '"$SKYSPOT_RUN_DIR/events/attempt-$n.node-0.rank-0.jsonl"'
    line = '{\\"type\\":\\"step\\",\\"step\\":%s,\\"ts\\":%s,\\"run\\":\\"run-1\\",\\"attempt\\":%s,\\"rank\\":0,\\"node_rank\\":0}'
    return "\n".join(
        [
            "trap 'exit 75' TERM",
            f"n=$(cat {counter})",  # this attempt's number: the fixture counts starts
            "sleep 0.5",
            f'for i in $(seq {first} {last}); do printf "{line}\\n" $i $(date +%s.%N) $n >> {events}; sleep 0.3; done',
            "exit 0",
        ]
    )


@pytest.mark.slow  # a deadline's switch end to end on the local controller, 13 s: the default suite is at its ten-minute line
def test_a_deadlines_switch_makes_the_new_node_ready_while_the_old_attempt_trains(nodes, tmp_path):  # noqa: F811
    """Spot is out for the first 5 s: the deadline starts on on-demand, gets ahead of its line and switches to
    spot. The spot node is provisioned while on-demand trains; only once it is ready does the on-demand attempt
    stop, and the spot attempt starts at once, billed from when its node was ready."""
    trace = tmp_path / "trace.yaml"
    trace.write_text("notice: 0\nunavailable: [[0, 5]]\n")
    counter = tmp_path / "attempts-started"
    nodes["run"] = [_stand_in(1, 40, counter), _stand_in(30, 40, counter)]
    result = runner.invoke(
        app,
        [
            "launch",
            "tiny",
            "--local",
            "-n",
            "run-1",
            "--provision-delay",
            str(PROVISION_S),
            "--spot-trace",
            str(trace),
            "--deadline",
            "120s",
            "train.steps=40",
            "resources.deadline_policy=uniform-progress",
            "resources.step_seconds_hint=0.3",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    log = read_events_dir(Path(Ledger().get("run-1").run_dir) / "events")
    starts, ends = log.of_type("attempt_start"), log.of_type("attempt_end")
    assert [s["where"]["spot"] for s in starts] == [False, True]
    assert [e["reason"] for e in ends] == ["switched", "complete"]
    switch = next(d for d in log.of_type(DECISION_EVENT) if d.get("switch"))
    assert (switch["from_mode"], switch["mode"]) == ("on-demand", "spot")
    handover = {e["decision"]: e for e in log.of_type("handover")}
    assert list(handover) == ["provisioning", "ready"]
    assert all(e["to"] == "spot" and e["reason"] == "deadline" for e in handover.values())
    provisioning, ready = handover["provisioning"]["ts"], handover["ready"]["ts"]
    assert switch["ts"] <= provisioning and ready - provisioning >= PROVISION_S
    # Make before break: the on-demand attempt stepped while the spot node was provisioned, and after the
    # decision; break-before-make would have stopped it at the decision.
    on_demand_steps = [e["ts"] for e in log.of_type("step") if e.get("attempt") == 1]
    assert [t for t in on_demand_steps if provisioning < t < ready]
    assert max(on_demand_steps) >= ready - 0.5
    # The spot attempt starts on the ready node: no second provisioning, billed from when it was ready.
    assert starts[1]["provisioned_at"] == pytest.approx(ready, abs=0.5)
    assert starts[1]["ts"] - ends[0]["ts"] < PROVISION_S
    text = Path(Ledger().get("run-1").run_dir, "logs", "run.log").read_text()
    assert f"deadline: provisioning a spot node in {PROVISION_S:.0f}s while this attempt trains" in text
    assert "switching to the spot node made ready while the last attempt trained" in text
    assert "recovering: provisioning a replacement" not in text
