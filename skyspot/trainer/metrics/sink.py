"""The sink: the run's events in, scalars out to every backend, on one background thread.

Why a thread: W&B and a remote MLflow answer over the network (an MLflow call is a blocking HTTP
request), so the training loop only enqueues; the thread opens the backends at the first scalar (by
then the attempt's `resume`, if any, is known), writes, and flushes whenever it has caught up.

No step drawn twice: a point goes to a backend only when the backend does not already hold that tag
at that step (`Backend.has`: TensorBoard purges what lies after the resume point, MLflow and W&B
answer from what they hold); the training is exact across resumes, so a redone step's value is the one
already there.

A backend that cannot be imported, opened or written costs one warning line (`say`), never the run:
one line when it cannot be opened (it is left out for this attempt) and one on its first failed write
(later points are still tried, silently).
"""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from skyspot.events import EventType as T

WATCHED = (T.START, T.RESUME, T.STEP, T.EVAL)
QUEUE_MAX = 100_000  # events; past it new ones are dropped (counted, said once at close)
CLOSE_SECONDS = {"complete": 60.0, "preempted": 3.0, "other": 10.0}
"""How long close waits for the backends to finish: a preempted node has its upload deadline to keep."""


@dataclass
class Context:
    """What a backend needs to open its run (the same for every backend of one start)."""

    run_id: str
    attempt: int
    run_dir: Path
    resumed_from: int
    """The step this start resumed from (0: a fresh start)."""
    settings: Any
    """The recipe's MetricsSection."""
    recipe: Any
    remember: Callable[[str, Any], None] = lambda key, value: None
    """Keep `key` in the run's run.json (and the store's copy): MLflow's run id."""
    recall: Callable[[str], Any] = lambda key: None
    say: Callable[[str], None] = lambda line: None
    """One line to the node's log (a credential withheld, trainer/metrics/hosts.py)."""


def backend_for(name: str, run_dir: Path, settings):
    """The backend named in metrics.backends; its library is imported only when it opens."""
    if name == "tensorboard":
        from skyspot.trainer.metrics.to_tensorboard import TensorBoard

        return TensorBoard(run_dir, settings)
    if name == "wandb":
        from skyspot.trainer.metrics.to_wandb import WandB

        return WandB(run_dir, settings)
    from skyspot.trainer.metrics.to_mlflow import MLflow

    return MLflow(run_dir, settings)


@dataclass
class _Backend:
    impl: Any
    warned: bool = False


@dataclass
class MetricsSink:
    """One start's sink. `observe` from any thread; `close` once, from the main thread."""

    run_id: str
    attempt: int
    run_dir: Path
    recipe: Any
    say: Callable[[str], None]
    earlier_events: Callable[[], list[dict]] = list
    """The run's events of earlier attempts (the spot story), read once on the sink's thread."""
    prices: list[dict] = field(default_factory=list)
    store: Any = None
    """The run's Store: the backends' local files are pulled from it first (a fresh node)."""
    uploader: Any = None
    """The node's uploader: the backends' local files are synced with the event files."""
    run_json: Callable[[], Any] = lambda: None
    """run.json updated: upload it (the store's copy is what a fresh node restores)."""

    def __post_init__(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_MAX)
        self._dropped = 0
        self._warned = False
        self._backends: Optional[list[_Backend]] = None
        self._start: Optional[dict] = None
        self._resumed_from = 0
        self._story = None
        self._last_tokens: Optional[tuple[int, int]] = None  # (step, cumulative tokens) of the last step event
        self._thread = threading.Thread(target=self._run, name="skyspot-metrics", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def observe(self, event: dict) -> None:
        if event.get("type") not in WATCHED:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._dropped += 1

    def close(self, code: int) -> None:
        """Finish every backend (W&B marks a preempted run as preempting), waiting at most CLOSE_SECONDS."""
        from skyspot.trainer.exit_codes import COMPLETE, PREEMPTED

        kind = "complete" if code == COMPLETE else "preempted" if code == PREEMPTED else "other"
        try:
            self._queue.put(("close", kind), timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(CLOSE_SECONDS[kind])
        if self._thread.is_alive():
            self.say(
                f"metrics: the dashboards did not finish within {CLOSE_SECONDS[kind]:g} s; the last points may be missing there"
            )
            if "wandb" in self.recipe.metrics.backends and "wandb" in sys.modules:
                from skyspot.trainer.metrics.to_wandb import abandon

                abandon()  # else wandb's exit hook holds the process until its server answers
        if self._dropped:
            self.say(f"metrics: {self._dropped} events were not sent to the dashboards (the queue was full)")

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, tuple):
                self._finish(item[1])
                return
            try:
                self._handle(item)
            except Exception as err:  # noqa: BLE001 - a dashboard never ends the run
                if not self._warned:
                    self._warned = True
                    self.say(f"metrics: {type(err).__name__}: {_one_line(err)}; the dashboards may miss points")
            if self._queue.empty():
                self._each("flush")

    def _handle(self, event: dict) -> None:
        kind = event["type"]
        if kind == T.START:
            self._start = event
            return
        if kind == T.RESUME:
            self._resumed_from = int(event.get("step") or 0)
            return
        if self._backends is None:
            self._open()
        self._point(event)

    def _point(self, event: dict, live: bool = True) -> None:
        step = int(event.get("step") or 0)
        if event["type"] == T.STEP:
            scalars = self._train_scalars(event, step, live)
        else:
            scalars = {"eval/loss": event.get("loss"), "eval/perplexity": event.get("perplexity")}
        scalars = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if scalars:
            self._write(step, scalars)

    def _backfill(self, earlier: list[dict]) -> None:
        """Send again, from the events, the points up to the resume point that a backend lost: what an
        attempt killed with its node had not yet made durable there (W&B's process buffers its records
        and dies with the node; an outage drops a batch). Events are written line by line, and `has`
        keeps every point the backend still holds out, so this only fills holes."""
        points: dict[tuple[int, int], dict] = {}
        for e in earlier:
            if (
                e.get("rank") == 0
                and e.get("type") in (T.STEP, T.EVAL)
                and isinstance(e.get("step"), int)
                and 0 < e["step"] <= self._resumed_from
            ):
                points[(e["step"], 0 if e["type"] == T.STEP else 1)] = e  # a redone step: the same values
        for key in sorted(points):
            self._point(points[key], live=False)

    def _train_scalars(self, event: dict, step: int, live: bool = True) -> dict[str, Any]:
        tokens = event.get("tokens")
        previous, self._last_tokens = self._last_tokens, (step, tokens) if isinstance(tokens, int) else None
        every = self.recipe.metrics.every_steps
        total = (self._start or {}).get("total_steps")
        if step % every and step != total:
            return {}
        scalars = {
            "train/loss": event.get("loss"),
            "train/lr": event.get("lr"),
            "train/grad_norm": event.get("grad_norm"),
        }
        seconds = event.get("step_seconds")
        if previous and previous[0] == step - 1 and isinstance(tokens, int) and seconds:
            scalars["train/tokens_per_second"] = (tokens - previous[1]) / seconds
        if self._story is not None and live:  # a backfilled point's story is not this attempt's
            scalars.update(self._story.scalars(float(event.get("ts") or time.time())))
        return scalars

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        for b in self._backends or []:
            try:
                fresh = {k: v for k, v in scalars.items() if not b.impl.has(k, step)}
                if fresh:
                    b.impl.log(step, fresh)
            except Exception as err:  # noqa: BLE001 - down, unauthorised, full: one line, later points still tried
                if not b.warned:
                    b.warned = True
                    self.say(
                        f"metrics: {b.impl.name} could not take step {step} ({_one_line(err)}); "
                        "later points are still tried, without further warnings"
                    )

    def _open(self) -> None:
        from skyspot.trainer.metrics.spot import story, where_text

        self._backends = []
        start = self._start or {"attempt": self.attempt, "ts": time.time(), "where": {}}
        earlier: list[dict] = []
        try:
            earlier = self.earlier_events()
            self._story = story(start, earlier, self.prices)
        except Exception as err:  # noqa: BLE001 - the story is advice; the curves go on without it
            self.say(
                f"metrics: the run's earlier attempts are unreadable ({_one_line(err)}); no cost or preemption curve"
            )
        ctx = Context(
            run_id=self.run_id,
            attempt=self.attempt,
            run_dir=self.run_dir,
            resumed_from=self._resumed_from,
            settings=self.recipe.metrics,
            recipe=self.recipe,
            remember=self._remember,
            recall=self._recall,
            say=self.say,
        )
        where = where_text(start.get("where") or {})
        for name in self.recipe.metrics.backends:
            try:
                impl = backend_for(name, self.run_dir, self.recipe.metrics)
                kept = impl.kept_dir()  # the backend's files to keep in the store, before it opens them
                if kept is not None:
                    self._pull(kept, impl.store_key)
                impl.open(ctx)
                if kept is not None and self.uploader is not None:
                    self.uploader.sync_also(kept, impl.store_key)
                impl.where(self._resumed_from, where, start.get("where") or {})
            except ImportError as err:
                self.say(
                    f"metrics: {name} is not installed on this node ({_one_line(err)}; pip install "
                    f"'skyspot[{name}]'); training goes on without it"
                )
                continue
            except Exception as err:  # noqa: BLE001 - down, unauthorised, misconfigured: one line
                self.say(f"metrics: {name} is unavailable ({_one_line(err)}); training goes on without it")
                continue
            self._backends.append(_Backend(impl))
        if self._backends:
            self.say(f"metrics: logging to {', '.join(b.impl.describe() for b in self._backends)}")
            self._backfill(earlier)

    def _pull(self, local: Path, key: str) -> None:
        """A fresh node: the backend's files the store holds and this node lacks (an earlier attempt's)."""
        if self.store is None:
            return
        from skyspot.storage import join_key

        prefix = join_key(self.run_id, key) + "/"
        for remote in self.store.list(prefix):
            target = local / remote[len(prefix) :]
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                self.store.get_file(remote, target)

    def _remember(self, key: str, value: Any) -> None:
        from skyspot.trainer.files import atomic_write_json, read_json
        from skyspot.trainer.rundir import RUN_JSON

        path = self.run_dir / RUN_JSON
        record = read_json(path)
        record = record if isinstance(record, dict) else {}
        if record.get(key) != value:
            record[key] = value
            atomic_write_json(path, record)
            self.run_json()

    def _recall(self, key: str) -> Any:
        from skyspot.trainer.files import read_json
        from skyspot.trainer.rundir import RUN_JSON

        record = read_json(self.run_dir / RUN_JSON)
        return record.get(key) if isinstance(record, dict) else None

    def _each(self, method: str, *args: Any) -> None:
        for b in self._backends or []:
            try:
                getattr(b.impl, method)(*args)
            except Exception as err:  # noqa: BLE001
                if not b.warned:
                    b.warned = True
                    self.say(f"metrics: {b.impl.name}: {method} failed ({_one_line(err)})")

    def _finish(self, kind: str) -> None:
        self._each("close", kind)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def attach(run, say: Callable[[str], None], environ=os.environ) -> MetricsSink:
    """The sink of this start (global rank 0), tapped into the rank's event writer: every event it
    writes from now on, from any module or thread, is observed."""
    from skyspot.events import read_events_dir
    from skyspot.trainer.metrics.spot import price_table

    def earlier() -> list[dict]:
        events = [e for e in read_events_dir(run.run_dir / "events").events if e.get("attempt") != run.attempt]
        if run.tier is not None:  # a fresh node has only the store's; a node that was SIGKILLed, fresher local ones
            here = {e.get("attempt") for e in events}
            events += [
                e for e in run.tier.read_events() if e.get("attempt") not in here and e.get("attempt") != run.attempt
            ]
        return events

    uploader = run.uploader
    sink = MetricsSink(
        run_id=run.run_id,
        attempt=run.attempt,
        run_dir=Path(run.run_dir),
        recipe=run.recipe,
        say=say,
        earlier_events=earlier,
        prices=price_table(environ),
        store=run.tier.store if run.tier is not None else None,
        uploader=uploader,
        run_json=(lambda: uploader.sync_small(Path(run.run_dir) / "run.json", "run.json"))
        if uploader is not None
        else (lambda: None),
    )
    writer = run.events
    emit = writer.emit

    def emit_and_observe(type: str, **fields: Any) -> dict:
        event = emit(type, **fields)
        sink.observe(event)
        return event

    writer.emit = emit_and_observe
    return sink
