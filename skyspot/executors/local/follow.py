"""Follow a local run until it ends: a rich live view on a terminal, plain lines otherwise.

The view reads only the ledger, the run's events and its log (the sources `status` and `logs`
use), so it can be closed and reopened at will; the run itself belongs to its controller process.
While an attempt has not reached its first step it says so every QUIET_SECONDS, with the log's
last line, so a slow start (imports, DeepSpeed building an op) never looks like a hang. A deadline
that becomes unreachable is said once, when the controller's decision finds it (`deadline_line`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.events import EVENTS_DIR, EventTail
from skyspot.executors.local.controller import NOT_RETRIED
from skyspot.ledger import Ledger
from skyspot.events import EventType as T

POLL_SECONDS = 0.5
QUIET_SECONDS = 20.0  # silence, before the first step of an attempt, after which the view says what is going on


class RunView:
    """What the follower knows about a run, folded from its events."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.step = 0
        self.loss: Optional[float] = None
        self.tokens_per_s: Optional[float] = None
        self.last_ckpt: Optional[int] = None
        self.last_ckpt_ts: Optional[float] = None
        self.preemptions = 0
        self.eval_loss: Optional[float] = None
        self.eval_step: Optional[int] = None
        self.restarts_in_place = 0
        self.hangs = 0
        self.attempt = 0
        self.where: dict[str, Any] = {}
        self.status = "PENDING"
        self.attempt_started: Optional[float] = None
        self.attempt_stepped = False
        self.unreachable_said = False  # a deadline's `unreachable` is said once, not at every decision
        self._last_tokens: Optional[tuple[int, int]] = None  # (step, run's tokens so far) of the last step event

    def apply(self, event: dict[str, Any]) -> Optional[str]:
        """Fold one event in; return a line worth printing, if any."""
        kind = event.get("type")
        if kind == T.ATTEMPT_START:
            self.attempt = event.get("attempt", self.attempt)
            self.where = event.get("where") or {}
            self.attempt_started, self.attempt_stepped = event.get("ts"), False
            w = self.where
            return (
                f"attempt {self.attempt}: {w.get('cloud')} {w.get('region')} {w.get('instance_type')} "
                f"({'spot' if w.get('spot') else 'on-demand'}, simulated)"
            )
        if kind == T.STEP and event.get("rank") in (0, None):
            self.step = max(self.step, int(event.get("step", 0)))
            self.attempt_stepped = True
            self.loss = _number(event.get("loss"), self.loss)
            self._rate(event)
            every = max(1, self.total // 20)
            if self.step % every == 0 or self.step == self.total:
                return f"step {self.step}/{self.total} {losses_text(self)}" if self.loss is not None else None
            return None
        if kind == T.EVAL and event.get("rank") in (0, None):
            loss = _number(event.get("loss"))
            if loss is None:  # a damaged line: the last good evaluation stands, with its own step
                return None
            self.eval_loss, self.eval_step = loss, event.get("step")
            ppl, seconds = _number(event.get("perplexity")), _number(event.get("seconds"))
            return (
                f"eval at step {event.get('step')}: loss {self.eval_loss:.4f}"
                + ("" if ppl is None else f" (perplexity {ppl:,.2f})")
                + ("" if seconds is None else f" in {seconds:.1f}s")
            )
        if kind == T.RESTART_IN_PLACE and event.get("rank") in (0, None):
            self.restarts_in_place += 1
            seconds = _number(event.get("seconds_to_next_step"))
            return (
                f"restarted in place (#{event.get('restart', self.restarts_in_place)}, {event.get('cause')}) from "
                f"step {event.get('step')}: "
                + ("" if seconds is None else f"{seconds:.1f}s from the failure to the next step, ")
                + f"{event.get('steps_redone', 0)} step(s) redone"
            )
        if kind == T.HANG:
            self.hangs += 1
            quiet, bound = _number(event.get("seconds_without_step")), _number(event.get("bound_seconds"))
            return (
                f"hang on node {event.get('node_rank')} at step {event.get('step')}: no step for "
                f"{'?' if quiet is None else f'{quiet:.0f}s'} (bound {'?' if bound is None else f'{bound:.0f}s'}); "
                f"stacks in {event.get('stacks')}; restarting its ranks"
            )
        if kind == T.CHECKPOINT_END and event.get("rank") in (0, None):
            self.last_ckpt, self.last_ckpt_ts = event.get("step"), event["ts"]
            if event.get("kind") not in ("interval", "emergency"):  # emergency: its own event says more
                return f"{event.get('kind')} checkpoint committed at step {event.get('step')}"
            return None
        if kind == T.PREEMPT_NOTICE_SENT:
            self.preemptions += 1
            return f"preemption notice (#{self.preemptions}) at step {event.get('step', self.step)}"
        if kind == T.EMERGENCY_CHECKPOINT and event.get("rank") in (0, None):
            return (
                f"emergency checkpoint at step {event.get('step')} committed "
                f"{event.get('signal_to_commit_seconds', 0):.2f}s after the notice"
            )
        if kind == T.RESUME and event.get("rank") in (0, None):
            return f"resumed from step {event.get('step')} ({event.get('source', 'local')})"
        if kind == T.DEADLINE_DECISION:
            return self._deadline(event)
        if kind == T.ATTEMPT_END:
            self.attempt_started = None
            cause = f": {event['cause']}" if event.get("cause") else ""
            return f"attempt {event.get('attempt')} ended: {event.get('reason')} (exit {event.get('code')}){cause}"
        return None

    def _deadline(self, event: dict[str, Any]) -> Optional[str]:
        """The line for the first decision that finds the deadline unreachable; None for every other."""
        from skyspot.planning import deadline as dl

        if event.get("reason") != dl.UNREACHABLE or self.unreachable_said:
            return None
        self.unreachable_said = True
        return deadline_line(event)

    def _rate(self, event: dict[str, Any]) -> None:
        """Tokens per second of this step. A step event's `tokens` is the run's total so far, so the
        step's own tokens are the difference from the step before it (unknown after a resume)."""
        step, total, seconds = event.get("step"), event.get("tokens"), event.get("step_seconds")
        if not (isinstance(step, int) and isinstance(total, (int, float))):
            return
        last, self._last_tokens = self._last_tokens, (step, int(total))
        if (
            last is not None
            and last[0] == step - 1
            and isinstance(seconds, (int, float))
            and seconds > 0
            and total >= last[1]
        ):
            self.tokens_per_s = (total - last[1]) / seconds

    def quiet_for(self, now: float) -> Optional[float]:
        """Seconds the current attempt has run without reaching a step, or None once it has."""
        if self.attempt_started is None or self.attempt_stepped or self.status not in ("STARTING", "RUNNING"):
            return None
        return now - self.attempt_started


def _number(value: Any, default: Optional[float] = None) -> Optional[float]:
    """A finite number from an event's field, else `default`: a damaged line never breaks the view."""
    import math

    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return default


def deadline_line(decision: dict[str, Any]) -> str:
    """`deadline UNREACHABLE: ...`: an unreachable decision for the launching terminal, with its projected
    finish and how long before the deadline it was found."""
    from skyspot.planning import deadline as dl

    at, finish, ts = (
        _number(decision.get("deadline")),
        _number(decision.get("projected_finish")),
        _number(decision.get("ts")),
    )
    late = f", {dl.span(finish - at)} late" if finish is not None and at is not None else ""
    ahead = f"; found {dl.span(at - ts)} before the deadline" if at is not None and ts is not None and ts < at else ""
    return (
        f"deadline UNREACHABLE: the deadline {dl.clock(at)} cannot be met any more; on-demand to the end, "
        f"projected finish {dl.clock(finish)}{late}{ahead}"
    )


def losses_text(view: RunView) -> str:
    """`loss 1.2345  eval loss 1.3000 (step 40)`: the newest train and eval loss the view has seen (#25)."""
    text = f"loss {'-' if view.loss is None else f'{view.loss:.4f}'}"
    if view.eval_loss is not None:
        text += f"  eval loss {view.eval_loss:.4f} (step {view.eval_step})"
    return text


def _exit_code(run) -> int:
    if run.status == "SUCCEEDED":
        return 0
    return run.exit_code or 1


def follow(name: str) -> int:
    with Ledger() as ledger:
        run = ledger.get(name)
        view = RunView(run.total_steps or 0)
        tail = EventTail(Path(run.run_dir) / EVENTS_DIR)
        log_path = Path(run.run_dir) / "logs" / "run.log"
        from skyspot.console import err, is_tty

        try:
            if is_tty() and sys.stderr.isatty():
                run = _follow_live(ledger, name, view, tail, log_path)
            else:
                run = _follow_plain(ledger, name, view, tail, log_path, err)
        except KeyboardInterrupt:
            err.print(
                f"detached; '{name}' keeps running. `skyspot logs {name} -f` follows it, "
                f"`skyspot cancel {name}` stops it"
            )
            return 130
        for line in ending(run):
            err.print(line, markup=False, highlight=False)
        return _exit_code(run)


def ending(run) -> list[str]:
    """What `launch` says when a run ends: its status, why it failed, and what to do next."""
    info = run.info
    lines = []
    cause = info.get("cause")
    if run.status == "SUCCEEDED":
        lines.append(f"run '{run.name}' SUCCEEDED; `skyspot status` and `skyspot cost-report {run.name}` summarise it")
    else:
        why = f": {cause}" if cause else ""
        lines.append(f"run '{run.name}' {run.status} (exit {_exit_code(run)}){why}")
        if run.exit_code in NOT_RETRIED:
            lines.append(
                f"not restarted: {NOT_RETRIED[run.exit_code]} fails the same way on every restart; "
                f"fix it and `skyspot launch` again (`skyspot logs {run.name}` has the full log)"
            )
        elif run.status == "FAILED_CONTROLLER":  # its cause says how to continue it
            lines.append(f"`skyspot logs {run.name}` has the full log")
        elif run.status != "CANCELLED":
            lines.append(
                f"`skyspot logs {run.name}` has the full log; `skyspot resume {run.name}` continues it "
                "from its newest checkpoint"
            )
    unused = info.get("unused_trace_times") or []
    if unused:
        after = info.get("finished_after_seconds")
        lines.append(
            f"note: the spot trace's preemption(s) at {', '.join(f'{t:g}s' for t in unused)} after launch "
            f"never came: the run finished {after:g}s after launch. Lengthen the run (e.g. train.steps=2000) "
            "or move the trace's times earlier (docs/local.md)"
            if isinstance(after, (int, float))
            else f"note: the spot trace's preemption(s) at {', '.join(f'{t:g}s' for t in unused)} never came: "
            "the run finished first"
        )
    return lines


def _last_log_line(path: Path, limit: int = 8192) -> Optional[str]:
    """The log's last non-empty line, one line, for "still starting" messages."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            data = handle.read()
    except OSError:
        return None
    lines = [
        line.strip()
        for line in data.decode("utf-8", errors="replace").splitlines()
        if line.strip() and not _noise(line)
    ]
    if not lines:
        return None
    text = lines[-1]
    return text if len(text) <= 160 else text[:157] + "..."


def _noise(line: str) -> bool:
    """Lines that say nothing about what a start waits on: warnings every start prints (torch's `W1130 ...`,
    DeepSpeed's accelerator notice) and the controller's own lines."""
    text = line.strip()
    return (
        "[WARNING]" in text
        or text.startswith("[skyspot local]")  # the controller's own lines
        or (len(text) > 5 and text[0] in "WI" and text[1:5].isdigit())
    )


def _activity(run) -> Optional[str]:
    text = run.info.get("activity") if isinstance(run.info, dict) else None
    return text if isinstance(text, str) and text else None


def _controller_gone(ledger, run) -> bool:
    """A controller that died without a word ends the view (executor.controller_gone marks the run)."""
    from skyspot.executors.local.liveness import controller_gone

    return not run.terminal and controller_gone(ledger, run)


def _follow_plain(ledger, name, view, tail, log_path, err):
    def say(line: str) -> None:
        err.print(f"[{name}] {line}", markup=False, highlight=False)

    activity, next_note = None, QUIET_SECONDS
    while True:
        run = ledger.get(name)
        for event in tail.poll():
            line = view.apply(event)
            if line:
                say(line)
            if event.get("type") == T.ATTEMPT_START:
                next_note = QUIET_SECONDS
        if _activity(run) != activity:
            activity = _activity(run)
            if activity:
                say(activity)
        if run.status != view.status:
            view.status = run.status
            say(run.status)
        quiet = view.quiet_for(time.time())
        if quiet is not None and quiet >= next_note:
            last = _last_log_line(log_path)
            doing = (
                "still preparing this machine (DeepSpeed's op build)"
                if run.status == "STARTING" and activity
                else "no step yet (starting: imports, DeepSpeed set-up, model load)"
            )
            say(f"attempt {view.attempt}: {quiet:.0f}s in, {doing}{f'; log: {last}' if last else ''}")
            next_note = quiet + 2 * QUIET_SECONDS
        if run.terminal or _controller_gone(ledger, run):
            return ledger.get(name)
        time.sleep(POLL_SECONDS)


def _follow_live(ledger, name, view, tail, log_path):
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from skyspot.console import err, printable

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err.console
    )
    task_id = progress.add_task(printable(name), total=view.total or None)
    lines: list[str] = []
    activity = None

    def render():
        w = view.where
        ckpt = "-" if view.last_ckpt is None else f"step {view.last_ckpt} ({time.time() - view.last_ckpt_ts:.0f}s ago)"
        quiet = view.quiet_for(time.time())
        doing = ""
        if quiet is not None and quiet >= 3:
            doing = f"\nstarting for {quiet:.0f}s: " + (
                activity or _last_log_line(log_path) or "imports, DeepSpeed set-up"
            )
        info = Text(
            printable(  # a Text is not a string the console escapes: escape here (console.py)
                f"{view.status}  attempt {view.attempt}  {w.get('cloud', '-')}/{w.get('region', '-')} "
                f"{w.get('instance_type', '-')} {'spot' if w.get('spot') else 'on-demand'}\n"
                f"{losses_text(view)}  "
                f"tokens/s {'-' if view.tokens_per_s is None else f'{view.tokens_per_s:,.0f}'}  "
                f"last checkpoint {ckpt}  preemptions {view.preemptions}"
                + (f"  in-place restarts {view.restarts_in_place}" if view.restarts_in_place or view.hangs else "")
                + (f" ({view.hangs} hang{'s' if view.hangs != 1 else ''})" if view.hangs else "")
                + doing,
                keep_newlines=True,
            )
        )
        return Group(progress, info, Text(printable("\n".join(lines[-6:]), keep_newlines=True), style="dim"))

    with Live(render(), console=err.console, refresh_per_second=4, transient=False) as live:
        while True:
            run = ledger.get(name)
            view.status = run.status
            for event in tail.poll():
                line = view.apply(event)
                if line:
                    lines.append(line)
            if _activity(run) != activity:
                activity = _activity(run)
                if activity:
                    lines.append(activity)
            progress.update(task_id, completed=view.step)
            live.update(render())
            if run.terminal or _controller_gone(ledger, run):
                return ledger.get(name)
            time.sleep(POLL_SECONDS)
