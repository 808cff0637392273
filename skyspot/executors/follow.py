"""Follow a local run until it ends: a rich live view on a terminal, plain lines otherwise.

The view reads only the ledger and the run's events (the same sources `status` uses), so
it can be closed and reopened at will; the run itself belongs to its controller process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.events import EVENTS_DIR, EventTail
from skyspot.ledger import Ledger

POLL_SECONDS = 0.5


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
        self.attempt = 0
        self.where: dict[str, Any] = {}
        self.status = "PENDING"

    def apply(self, event: dict[str, Any]) -> Optional[str]:
        """Fold one event in; return a line worth printing, if any."""
        kind = event.get("type")
        if kind == "attempt_start":
            self.attempt = event.get("attempt", self.attempt)
            self.where = event.get("where") or {}
            w = self.where
            return (f"attempt {self.attempt}: {w.get('cloud')} {w.get('region')} {w.get('instance_type')} "
                    f"({'spot' if w.get('spot') else 'on-demand'}, simulated)")
        if kind == "step" and event.get("rank") in (0, None):
            self.step = max(self.step, int(event.get("step", 0)))
            self.loss = event.get("loss", self.loss)
            seconds = event.get("step_seconds") or 0
            if seconds and event.get("tokens"):
                self.tokens_per_s = event["tokens"] / seconds
            every = max(1, self.total // 20)
            if self.step % every == 0 or self.step == self.total:
                return f"step {self.step}/{self.total} loss {self.loss:.4f}" if self.loss is not None else None
            return None
        if kind == "checkpoint_end" and event.get("rank") in (0, None):
            self.last_ckpt, self.last_ckpt_ts = event.get("step"), event["ts"]
            if event.get("kind") not in ("interval", "emergency"):  # emergency: its own event says more
                return f"{event.get('kind')} checkpoint committed at step {event.get('step')}"
            return None
        if kind == "preempt_notice_sent":
            self.preemptions += 1
            return f"preemption notice (#{self.preemptions}) at step {event.get('step', self.step)}"
        if kind == "emergency_checkpoint" and event.get("rank") in (0, None):
            return (f"emergency checkpoint at step {event.get('step')} committed "
                    f"{event.get('signal_to_commit_seconds', 0):.2f}s after the notice")
        if kind == "resume" and event.get("rank") in (0, None):
            return f"resumed from step {event.get('step')} ({event.get('source', 'local')})"
        if kind == "attempt_end":
            return f"attempt {event.get('attempt')} ended: {event.get('reason')} (exit {event.get('code')})"
        return None


def _exit_code(run) -> int:
    if run.status == "SUCCEEDED":
        return 0
    return run.exit_code or 1


def follow(name: str) -> int:
    ledger = Ledger()
    try:
        run = ledger.get(name)
        view = RunView(run.total_steps or 0)
        tail = EventTail(Path(run.run_dir) / EVENTS_DIR)
        from skyspot.cli.common import err, is_tty

        try:
            if is_tty() and sys.stderr.isatty():
                run = _follow_live(ledger, name, view, tail)
            else:
                run = _follow_plain(ledger, name, view, tail, err)
        except KeyboardInterrupt:
            err.print(f"detached; '{name}' keeps running. `skyspot logs {name} -f` follows it, "
                      f"`skyspot cancel {name}` stops it")
            return 130
        err.print(f"run '{name}' {run.status} (exit {_exit_code(run)}); "
                  f"`skyspot status` and `skyspot cost-report {name}` summarise it")
        return _exit_code(run)
    finally:
        ledger.close()


def _follow_plain(ledger, name, view, tail, err):
    def say(line: str) -> None:
        err.print(f"[{name}] {line}", markup=False, highlight=False)

    while True:
        run = ledger.get(name)
        for event in tail.poll():
            line = view.apply(event)
            if line:
                say(line)
        if run.status != view.status:
            view.status = run.status
            say(run.status)
        if run.terminal:
            return run
        time.sleep(POLL_SECONDS)


def _follow_live(ledger, name, view, tail):
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from skyspot.cli.common import err

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err)
    task_id = progress.add_task(name, total=view.total or None)
    lines: list[str] = []

    def render():
        w = view.where
        ckpt = "-" if view.last_ckpt is None else f"step {view.last_ckpt} ({time.time() - view.last_ckpt_ts:.0f}s ago)"
        info = Text(
            f"{view.status}  attempt {view.attempt}  {w.get('cloud', '-')}/{w.get('region', '-')} "
            f"{w.get('instance_type', '-')} {'spot' if w.get('spot') else 'on-demand'}\n"
            f"loss {'-' if view.loss is None else f'{view.loss:.4f}'}  "
            f"tokens/s {'-' if view.tokens_per_s is None else f'{view.tokens_per_s:,.0f}'}  "
            f"last checkpoint {ckpt}  preemptions {view.preemptions}")
        return Group(progress, info, Text("\n".join(lines[-6:]), style="dim"))

    with Live(render(), console=err, refresh_per_second=4, transient=False) as live:
        while True:
            run = ledger.get(name)
            view.status = run.status
            for event in tail.poll():
                line = view.apply(event)
                if line:
                    lines.append(line)
            progress.update(task_id, completed=view.step)
            live.update(render())
            if run.terminal:
                return run
            time.sleep(POLL_SECONDS)
