"""The local executor's controller and `launch`'s view of it, with stand-in nodes (no training).

`launch tiny --local` runs through the CLI as a user types it; only the node's run script (and the
one-time op build) in the controller's spec is swapped for a few lines of bash that behave like the
trainer at its edges: an exit code, the exit record it writes, torchrun's report, slow starts. So
these run in seconds; tests/executors/local/test_local_executor.py runs the real trainer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.executors.local import follow as follow_module
from skyspot.executors.local import executor as local_module
from skyspot.executors.local.follow import RunView
from skyspot.executors.local.controller import _deepspeed_dir, deepspeed_op_cached
from skyspot.ledger import Ledger

runner = CliRunner()

REASON = (
    "store s3://my-bucket/x/run: cannot list s3://my-bucket/x/run/checkpoints: no AWS credentials found; "
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role"
)


def exits_with(code: int, reason: str, *, report: bool = True) -> str:
    """A node that stops the way the trainer does: its exit record, torchrun's report, the supervisor's line."""
    record = json.dumps({"code": code, "reason": reason})
    lines = [
        f"echo '[skyspot] {reason}'",
        f'{sys.executable} -c \'import json, os, sys, time; r = json.loads(sys.argv[1]); r["ts"] = time.time(); '
        f'json.dump(r, open(os.path.join(os.environ["SKYSPOT_RUN_DIR"], "exit.json"), "w"))\' \'{record}\'',
    ]
    if report:
        lines += [
            f"echo 'E1130 19:00:11.698000 22302 torch/distributed/elastic/multiprocessing/api.py:1002] "
            f"failed (exitcode: {code}) local_rank: 0 (pid: 22315) of binary: python'",
            "echo 'Traceback (most recent call last):'",
            "echo '  File \"torchrun\", line 8, in <module>'",
            "echo 'torch.distributed.elastic.multiprocessing.errors.ChildFailedError: '",
            "echo '============================================================'",
            "echo 'skyspot.trainer FAILED'",
            "echo '============================================================'",
            f"echo '[skyspot.supervise] trainer exit {code} (...: {reason}); torchrun exited 1'",
        ]
    return "\n".join(lines + [f"exit {code}"])


@pytest.fixture
def nodes(monkeypatch, tmp_path):
    """Swap the node's run script (a list, one per attempt in turn; the last repeats) and the op build."""
    scripts: dict[str, object] = {"run": ["exit 0"], "prepare": None}
    real = local_module.make_spec

    def fake_spec(built, name, options):
        spec = real(built, name, options)
        runs = scripts["run"]
        counter = tmp_path / "attempts-started"
        # Attempt k runs script k (the last repeats): a counter file picks it, since each attempt is a new shell.
        script = f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}"
        bodies = [f'if [ "$n" = {i} ]; then\n{body}\nfi' for i, body in enumerate(runs[:-1])]
        script = "\n".join([script, *bodies, runs[-1]])
        changes = {"run_script": script}
        if scripts["prepare"] is not None:
            changes["prepare_script"] = scripts["prepare"]
        return replace(spec, **changes)

    monkeypatch.setattr(local_module, "make_spec", fake_spec)
    built_ops = tmp_path / "torch-extensions"
    (built_ops / "deepspeed_shm_comm").mkdir(parents=True)
    (built_ops / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    (built_ops / "deepspeed_shm_comm" / "build.ninja").write_text(
        f"build shm.o: compile {_deepspeed_dir()}/ops/csrc/cpu/comm/shm.cpp\n"
    )
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(built_ops))  # built already, unless a test says not
    return scripts


def launch(*args: str):
    result = runner.invoke(
        app, ["launch", "tiny", "--local", "-n", "run-1", "--provision-delay", "0", *args], catch_exceptions=False
    )
    return result


def executor_attempts(name: str = "run-1") -> list[dict]:
    run_dir = Path(Ledger().get(name).run_dir)
    return [e for e in read_events_dir(run_dir / "events").events if e["type"] in ("attempt_start", "attempt_end")]


def test_a_configuration_error_fails_at_once_and_says_why(nodes):
    nodes["run"] = [exits_with(2, f"usage error: {REASON}")]
    result = launch()
    assert result.exit_code == 2
    said = result.stderr
    assert said.count("attempt 1 ended: error (exit 2)") == 1 and "attempt 2" not in said
    assert f"attempt 1 ended: error (exit 2): usage error: {REASON}" in said
    assert "run 'run-1' FAILED (exit 2): usage error: store s3://my-bucket/x/run" in said
    assert "not restarted: a configuration error fails the same way on every restart" in said
    events = executor_attempts()
    assert [(e["type"], e["attempt"]) for e in events] == [("attempt_start", 1), ("attempt_end", 1)]
    assert events[-1]["cause"] == f"usage error: {REASON}"
    run = Ledger().get("run-1")
    assert (run.status, run.exit_code) == ("FAILED", 2) and "no AWS credentials" in run.info["cause"]
    log = runner.invoke(app, ["logs", "run-1"]).stdout
    assert "not restarted: exit 2 is a configuration error" in log and "restart 1/3" not in log
    assert "errors.ChildFailedError" in log  # a real failure keeps torchrun's report


def test_a_crash_is_retried_under_a_new_attempt_number_each_time(nodes):
    nodes["run"] = [exits_with(1, "RuntimeError: boom")]
    result = launch()
    assert result.exit_code == 1
    for attempt in (1, 2, 3, 4):  # max_restarts_on_errors: 3
        assert f"attempt {attempt} ended: error (exit 1): RuntimeError: boom" in result.stderr
    assert "attempt 5" not in result.stderr
    assert [e["attempt"] for e in executor_attempts() if e["type"] == "attempt_start"] == [1, 2, 3, 4]
    # The trainer never counted these starts (it failed first); its counter is moved up to match, so
    # the start after this one would log under attempt 5, as the executor's events do.
    run_dir = Path(Ledger().get("run-1").run_dir)
    assert json.loads((run_dir / "attempts.json").read_text())["attempt"] == 3
    log = runner.invoke(app, ["logs", "run-1"]).stdout
    assert "restart 3/3 after an error" in log


def test_a_preemption_does_not_fill_the_log_with_torchruns_failure_report(nodes):
    nodes["run"] = [exits_with(75, "preempted: emergency checkpoint step_67 committed"), "exit 0"]
    result = launch()
    assert result.exit_code == 0, result.stderr
    assert "attempt 1 ended: preempted (exit 75)" in result.stderr
    assert "run 'run-1' SUCCEEDED" in result.stderr
    log = runner.invoke(app, ["logs", "run-1"]).stdout
    assert "errors.ChildFailedError" not in log and "Traceback" not in log and "skyspot.trainer FAILED" not in log
    assert "torchrun's ChildFailedError report omitted: the trainer exited 75" in log
    assert "[skyspot.supervise] trainer exit 75" in log  # the line that says what happened stays


def test_the_first_run_on_a_machine_says_it_is_building_the_op(nodes, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "nothing-built"))
    monkeypatch.setattr(follow_module, "QUIET_SECONDS", 0.5)
    nodes["prepare"] = "echo 'Building extension module deepspeed_shm_comm...'; sleep 3"
    nodes["run"] = ["sleep 1.5; exit 0"]
    result = launch()
    assert result.exit_code == 0, result.stderr
    said = result.stderr
    building = said.index("preparing this machine once: DeepSpeed builds its CPU communication op")
    assert building < said.index("RUNNING") and "op ready after" in said
    assert "s in, still preparing this machine (DeepSpeed's op build)" in said
    assert "; log: Building extension module deepspeed_shm_comm..." in said
    log = runner.invoke(app, ["logs", "run-1"]).stdout
    assert "Building extension module deepspeed_shm_comm" in log


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is left


def test_a_cancel_during_the_op_build_ends_the_builds_whole_process_group(nodes, monkeypatch, tmp_path):
    """Issue 31, item 5: a cancel while `prepare` builds DeepSpeed's op left the compilers running (and
    torch's lock held). The build runs in a session of its own, and a cancel kills that whole group."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "nothing-built"))
    compiler = tmp_path / "compiler.pid"
    nodes["prepare"] = f"sleep 300 & echo $! > {compiler}; wait"  # a compiler the build started
    started = launch("-d")
    assert started.exit_code == 0, started.output
    deadline = time.time() + 60
    while not compiler.exists() and time.time() < deadline:
        time.sleep(0.1)
    pid = int(compiler.read_text())
    assert _alive(pid) and os.getpgid(pid) != os.getpgid(0)
    cancelled = runner.invoke(app, ["cancel", "run-1", "-y"])
    assert cancelled.exit_code == 0, cancelled.output
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the build's child outlived the cancel"
    assert Ledger().get("run-1").status == "CANCELLED"


def test_an_op_already_built_is_not_built_again(nodes):
    nodes["prepare"] = "echo SHOULD-NOT-RUN; exit 1"
    result = launch()
    assert result.exit_code == 0 and "preparing this machine" not in result.stderr
    assert "SHOULD-NOT-RUN" not in runner.invoke(app, ["logs", "run-1"]).stdout


def test_an_op_built_from_another_deepspeed_install_is_built_again(nodes, tmp_path, monkeypatch):
    """Torch rebuilds an op whose sources moved (another checkout's venv, a CI clone): at the trainer's
    start, where a preemption would interrupt it. So it is prepared first, like a missing one."""
    stale = tmp_path / "other-extensions" / "deepspeed_shm_comm"
    stale.mkdir(parents=True)
    (stale / "deepspeed_shm_comm.so").write_bytes(b"")
    (stale / "build.ninja").write_text("build shm.o: compile /elsewhere/venv/deepspeed/ops/csrc/cpu/comm/shm.cpp\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(stale.parent))
    assert not deepspeed_op_cached()
    nodes["prepare"] = "echo PREPARED"
    result = launch()
    assert result.exit_code == 0, result.stderr
    log = runner.invoke(app, ["logs", "run-1"]).stdout
    assert "PREPARED" in log and "DeepSpeed's op ready after" in log


def test_a_slow_start_is_reported_with_the_logs_last_line(nodes, monkeypatch):
    monkeypatch.setattr(follow_module, "QUIET_SECONDS", 0.5)
    nodes["run"] = [
        "echo 'Emitting ninja build file /tmp/x/build.ninja...'\n"
        "echo 'W1130 19:00:11.698000 22302 torch/distributed/run.py:874] *****'\n"
        "echo '[2026-11-30 19:24:57,521] [WARNING] [real_accelerator.py:213:get_accelerator] Setting "
        "accelerator to CPU.'\nsleep 2.5; exit 0"
    ]
    result = launch()
    assert result.exit_code == 0
    assert "attempt 1: " in result.stderr and "no step yet" in result.stderr
    assert "log: Emitting ninja build file /tmp/x/build.ninja..." in result.stderr


def test_a_spot_trace_that_falls_after_the_run_says_so(nodes, tmp_path):
    trace = tmp_path / "trace.yaml"
    trace.write_text("preemptions: [40, 100]\nnotice: 10\n")
    result = launch("--spot-trace", str(trace))
    assert result.exit_code == 0
    assert "note: the spot trace's preemption(s) at 40s, 100s after launch never came" in result.stderr
    assert "train.steps=2000" in result.stderr


def test_a_trace_whose_capacity_ran_out_is_not_reported_as_unused(nodes, tmp_path):
    trace = tmp_path / "trace.yaml"
    trace.write_text("preemptions: [0, 300]\nnotice: 0\ncapacity_gone_after: 1\n")
    nodes["run"] = ["sleep 3; exit 0"]
    result = launch("--spot-trace", str(trace))
    assert result.exit_code == 0, result.stderr
    assert "attempt 2" in result.stderr and "never came" not in result.stderr


# --------------------------------------------------------------------------- the live view's figures


def _step(step: int, tokens: int, seconds: float) -> dict:
    return {
        "type": "step",
        "rank": 0,
        "step": step,
        "tokens": tokens,
        "step_seconds": seconds,
        "loss": 2.0,
        "ts": 1.0 + step,
    }


def test_tokens_per_second_is_one_steps_tokens_over_its_time():
    view = RunView(200)
    view.apply(_step(1, 1024, 0.1))
    assert view.tokens_per_s is None  # one step: its own tokens are not known yet
    view.apply(_step(2, 2048, 0.08))
    assert view.tokens_per_s == pytest.approx(1024 / 0.08)  # 12,800, not the run's 2,048 tokens / 0.08 s
    view.apply(_step(3, 3072, 0.1))
    assert view.tokens_per_s == pytest.approx(10240)
    view.apply(_step(67, 68608, 0.1))  # after a resume: no step before it in view, the last figure stays
    assert view.tokens_per_s == pytest.approx(10240)


def test_the_live_view_follows_a_run_to_its_end(tmp_path):
    """The terminal view (rich Live and Progress on the stderr console) runs and folds the events in."""
    from skyspot.events import EVENTS_DIR, EventTail, EventWriter
    from skyspot.ledger import skyspot_home

    run_dir = skyspot_home() / "runs" / "live"
    executor = EventWriter(run_dir, "live", 1, 0, None)
    executor.emit("attempt_start", where={"cloud": "aws", "region": "us-east-1", "spot": True, "simulated": True})
    trainer = EventWriter(run_dir, "live", 1, 0, 0)
    for step in range(1, 5):
        trainer.emit("step", step=step, loss=2.0, step_seconds=0.1, tokens=1000 * step)
    trainer.emit("eval", step=4, loss=1.5, perplexity=4.48, tokens=64, batches=1, seconds=0.1)
    executor.emit("attempt_end", code=0, reason="complete")
    ledger = Ledger()
    ledger.add("live", "tiny", "local", run_dir=str(run_dir), total_steps=4, num_nodes=1)
    ledger.set_status("live", "SUCCEEDED")
    view = RunView(4)
    run = follow_module._follow_live(
        ledger, "live", view, EventTail(run_dir / EVENTS_DIR), run_dir / "logs" / "run.log"
    )
    assert run.status == "SUCCEEDED" and view.step == 4 and (view.eval_loss, view.eval_step) == (1.5, 4)
    assert view.tokens_per_s == pytest.approx(1000 / 0.1)


def test_the_live_view_shows_the_latest_train_and_eval_loss_and_each_in_place_restart():
    from tests.builders import eval_event, event, hang_event, restart_event

    view = RunView(20)
    assert view.apply(event(1, "step", 0, step=10, loss=1.5, step_seconds=0.1)) == "step 10/20 loss 1.5000"
    line = view.apply(eval_event(2, 0, step=10, loss=1.25, seconds=0.5))
    assert line == "eval at step 10: loss 1.2500 (perplexity 3.49) in 0.5s"
    assert (
        view.apply(event(3, "step", 0, step=20, loss=1.0, step_seconds=0.1))
        == "step 20/20 loss 1.0000  eval loss 1.2500 (step 10)"
    )
    assert "hang on node 1 at step 20: no step for 30s (bound 20s); stacks in stacks/hang-1" in view.apply(
        hang_event(40, 0, node_rank=1, step=20, seconds_without_step=30, bound_seconds=20)
    )
    assert (
        view.apply(restart_event(50, 0, failed_at=41, step=20, steps_redone=0, cause="hang"))
        == "restarted in place (#1, hang) from step 20: 9.0s from the failure to the next step, 0 step(s) redone"
    )
    assert (view.restarts_in_place, view.hangs, view.eval_loss, view.loss) == (1, 1, 1.25, 1.0)
    # A damaged figure never breaks the view: the last good loss stays.
    assert view.apply({**eval_event(60, 0, step=20, loss=1.0), "loss": "low"}) is None
    view.apply({**event(61, "step", 0, step=20, step_seconds=0.1), "loss": None})
    assert (view.eval_loss, view.loss) == (1.25, 1.0)
    assert follow_module.losses_text(view) == "loss 1.0000  eval loss 1.2500 (step 10)"


def test_a_resumed_local_run_trains_with_its_recorded_settings_not_the_shells(tmp_path, monkeypatch):
    """Issue 31, item 6: `SKYSPOT_TRAIN__LR=0.9 skyspot resume RUN` changed the run's learning rate (its loss
    went 2.85 -> 19.2). The launch records the overrides it applied in the trainer's own arguments; the
    nodes get none of the shell's SKYSPOT_<SECTION>__<KEY>, and `resume` says it ignored them."""
    from typer.testing import CliRunner

    from skyspot.app.launch import build
    from skyspot.cli.main import app
    from skyspot.executors.local.controller import Controller
    from skyspot.executors.local.executor import LocalOptions, make_spec
    from skyspot.ledger import Ledger

    launched = build("tiny", local=True, environ={"SKYSPOT_TRAIN__LR": "0.003"})
    assert "train.lr=0.003" in launched.task["run"]  # the launch's own, recorded in the task
    monkeypatch.setenv("SKYSPOT_TRAIN__LR", "0.9")
    monkeypatch.setenv("SKYSPOT_HOME_UNRELATED", "kept")  # not an override: stays
    spec = make_spec(launched, "lr-run", LocalOptions())
    with Ledger() as ledger:
        controller = Controller(tmp_path / "run", spec, ledger)
        where = {
            "cloud": "aws",
            "region": "us-east-1",
            "zone": "us-east-1a",
            "num_nodes": 1,
            "instance_type": "m6i.large",
            "spot": True,
        }
        env = controller.node_env(0, where, {}, 29500)
    assert "SKYSPOT_TRAIN__LR" not in env and env["SKYSPOT_HOME_UNRELATED"] == "kept"
    with Ledger() as ledger:
        ledger.add("lr-run", "tiny", "local", run_dir=str(tmp_path / "gone"), total_steps=5, num_nodes=1)
        ledger.set_status("lr-run", "CANCELLED")
    said = CliRunner().invoke(app, ["resume", "lr-run", "-y", "-d"])
    assert said.exit_code != 0  # its run dir is gone: it cannot start, but it said what it ignored first
    assert (
        "note: ignoring SKYSPOT_TRAIN__LR from this shell: a resumed run keeps the settings it was launched "
        "with" in said.stderr
    )


# A deadline the prior's arithmetic loses within seconds of the launch: all on-demand needs start-up 30s
# (the local prior, provision delay 0) + 200 steps x 0.04s = 38s of the 46s left, so the launch takes it, and
# 8 s without a step (the machine's preparation; the controller's own start is well under that) make it
# unreachable long before it passes.
TIGHT_DEADLINE = ("--deadline", "46s", "resources.step_seconds_hint=0.04")


def _unreachable_decisions(name: str = "run-1") -> list[dict]:
    run_dir = Path(Ledger().get(name).run_dir)
    return [e for e in read_events_dir(run_dir / "events").of_type("deadline_decision") if e["reason"] == "unreachable"]


def test_a_deadline_lost_while_the_machine_is_prepared_is_said_on_the_terminal_before_it_passes(
    nodes, tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "nothing-built"))
    # The op build lasts until the controller has recorded the deadline unreachable (at most 30 s, then it
    # fails): what the test waits on is that event, not a clock.
    nodes["prepare"] = (
        'for i in $(seq 300); do grep -qs \'"reason":"unreachable"\' events/deadline.jsonl && exit 0; '
        "sleep 0.1; done; exit 1"
    )
    started = tmp_path / "node-started"
    nodes["run"] = [f"{sys.executable} -c 'import time; print(time.time())' > {started}; exit 0"]
    result = launch(*TIGHT_DEADLINE)
    assert result.exit_code == 0, result.stderr
    said = result.stderr
    log = runner.invoke(app, ["logs", "run-1"]).stdout
    assert "DeepSpeed's op ready after" in log  # the preparation ended on the decision, not on its bound
    first, *_ = _unreachable_decisions()
    at = Ledger().get("run-1").info["deadline"]["at"]
    # Found while the machine was being prepared, before the node started, long before the deadline.
    assert first["ts"] < float(started.read_text()) < at
    assert first["overhead_left"] == 30.0 and first["mode"] == "on-demand" and first["projected_finish"] > at
    # On the launching terminal: once, with the projection, before the attempt ended.
    assert said.count("deadline UNREACHABLE") == 1
    assert said.index("deadline UNREACHABLE") < said.index("attempt 1 ended")
    assert "cannot be met any more; on-demand to the end, projected finish" in said
    assert "before the deadline" in said
    assert log.count("deadline UNREACHABLE") == 1  # and once in run.log, where the policy changed its mind


@pytest.mark.slow  # the controller's deadline while the machine is prepared, 10 s: the default suite is at its ten-minute line
def test_status_shows_a_deadline_unreachable_while_the_machine_is_still_prepared(nodes, tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "nothing-built"))
    release = tmp_path / "release"
    nodes["prepare"] = f"for i in $(seq 300); do [ -e {release} ] && exit 0; sleep 0.1; done; exit 1"
    nodes["run"] = ["exit 0"]
    assert launch("-d", *TIGHT_DEADLINE).exit_code == 0
    try:
        at = Ledger().get("run-1").info["deadline"]["at"]
        row: dict = {}
        while time.time() < at and not (row.get("deadline") or {}).get("unreachable"):
            row = json.loads(runner.invoke(app, ["status", "--json"]).stdout)[0]
            time.sleep(0.2)
        assert row["deadline"]["unreachable"] is True and time.time() < at
        assert row["status"] == "STARTING" and row["step"] == 0  # still preparing: not one step yet
        table = runner.invoke(app, ["status"]).stdout
        assert "UNREACHABLE, on-demand to the end, ETA" in table and "> LATE" in table
    finally:
        release.touch()
        ends = time.time() + 60
        while not Ledger().get("run-1").terminal and time.time() < ends:
            time.sleep(0.2)
    assert Ledger().get("run-1").status == "SUCCEEDED"


def test_a_fresh_nodes_setup_ticks_while_it_runs_so_the_deadline_is_judged_there(tmp_path):
    import io
    import os
    import subprocess
    from types import SimpleNamespace

    from skyspot.executors.local import fresh_node

    go = tmp_path / "go"
    ticks: list[int] = []

    def tick() -> None:  # the controller's deadline judgement runs here; the second one lets the setup finish
        ticks.append(1)
        if len(ticks) == 2:
            go.touch()

    log = io.StringIO()
    node = SimpleNamespace(root=tmp_path)
    script = f"echo started; for i in $(seq 200); do [ -e {go} ] && break; sleep 0.05; done; echo done; exit 3"
    assert fresh_node.run_setup(node, script, dict(os.environ), log, tick=tick) == 3
    assert len(ticks) >= 2 and log.getvalue() == "started\ndone\n"
    with pytest.raises(subprocess.TimeoutExpired):  # a bounded setup stays bounded
        fresh_node.run_setup(node, "sleep 5", dict(os.environ), timeout=0.3)
