"""Runs read back: a run's events (its run root, or the store) and the summary `status` shows for each run.
`cost-report`'s use-case, the deadline comparison included, is app/report.py.

Naming runs and recording a launch are the ledger's (skyspot/ledger.py)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from skyspot.events import Event, EventLog
    from skyspot.ledger import Run


def run_events(run: Run, *, store_ok: bool = True) -> EventLog:
    """A run's events: its local run root, else (cloud runs) `<store>/<name>/events/` in the bucket, whose
    files are then kept on this machine for the preemption history (events_copy.py)."""
    from pathlib import Path

    from skyspot.events import EVENTS_DIR, EventLog, read_events_dir, read_events_store

    if run.run_dir and Path(run.run_dir, EVENTS_DIR).is_dir():
        log = read_events_dir(Path(run.run_dir) / EVENTS_DIR)
        # Local multi-node runs: the other nodes' own disks (signals and notices they saw).
        for node_events in sorted(Path(run.run_dir).glob(f"nodes/node-*/{EVENTS_DIR}")):
            log.merge(read_events_dir(node_events))
        log.events.sort(key=lambda e: e["ts"])
        return log
    log = EventLog()
    if not (store_ok and run.store):
        return log
    from skyspot.events_copy import Copy
    from skyspot.storage import open_store

    # Kept on this machine as read, for the preemption history, which reads no store (events_copy.py).
    with Copy(run.name) as copy:
        return read_events_store(open_store(run.store), run.name, keep=copy.add)


def event_names(run: Run) -> list[str]:
    """The names of a run's events files where run_events would read them (node 0's directory, or the
    store's keys), without reading one."""
    from pathlib import Path

    from skyspot.events import EVENTS_DIR

    if run.run_dir and Path(run.run_dir, EVENTS_DIR).is_dir():
        try:
            return [entry.name for entry in os.scandir(Path(run.run_dir) / EVENTS_DIR)]
        except OSError:
            return []
    if not run.store:
        return []
    from skyspot.storage import join_key, open_store

    return open_store(run.store).list(join_key(run.name, EVENTS_DIR) + "/")


SETUP_RECORD_MAX_BYTES = 64 * 1024  # a setup record is a few hundred bytes; a bigger one is not ours


def setup_failure(run: Run) -> Optional[str]:
    """Why the run's setup could not mend its node, as the newest `<store>/<name>/setup/node-<rank>.json`
    (node_env.record_failure) says it; None without a store, a record, or a readable one."""
    import json

    if not run.store:
        return None
    from skyspot.storage import join_key, open_store

    store = open_store(run.store)
    newest = None
    for key in sorted(store.list(join_key(run.name, "setup") + "/"))[:64]:
        data = store.get_bytes(key) if key.endswith(".json") else None
        try:
            record = json.loads(data[:SETUP_RECORD_MAX_BYTES]) if data else None
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and record.get("type") == "setup_failed" and isinstance(record.get("error"), str):
            if newest is None or str(record.get("ts")) > str(newest.get("ts")):
                newest = {**record, "node": key.rsplit("/", 1)[-1].removesuffix(".json")}
    if newest is None:
        return None
    return (
        f"setup failed on {newest['node']}: {newest['error'].splitlines()[0][:300]} [driver {newest.get('driver')}, "
        f"python {newest.get('python')}, image {newest.get('image')}, instance {newest.get('instance')}]"
    )


def events_signature(run: Run) -> Optional[str]:
    """Names, sizes and modification times of a local run's event files: a cached summary is
    reused only while this is unchanged."""
    from pathlib import Path

    if not run.run_dir:
        return None
    root = Path(run.run_dir)
    parts = []
    # The run's own events/ by names and os.stat, not glob and Paths: 40,000 files for 20,000 attempts (issue 31).
    # The names glob's "*.jsonl" gives (no dot files), in the same order; other nodes' events (rare) by glob.
    events = os.path.join(root, "events")
    try:
        names = sorted(n for n in os.listdir(events) if n.endswith(".jsonl") and not n.startswith("."))
    except OSError:
        names = []
    for name in names:
        try:
            found = os.stat(os.path.join(events, name))
        except OSError:
            continue
        parts.append(f"events/{name}:{found.st_size}:{found.st_mtime_ns}")
    for path in sorted(root.glob("nodes/node-*/events/*.jsonl")):
        try:
            stat = path.stat()
        except OSError:
            continue
        parts.append(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def summarize(
    run: Run, log: EventLog, queue_record: Optional[Mapping[str, Any]] = None, now: Optional[float] = None
) -> dict[str, Any]:
    """One `status` row: where it runs, progress, recoveries and what interrupted its attempts, durable
    checkpoint, elapsed, cost so far, and for a run that failed, why (`cause`, as the local executor recorded it)."""
    from skyspot.attempts import count_causes, is_simulated, split
    from skyspot.node_kinds import node_kinds
    from skyspot.pricing.cost import cost_so_far
    from skyspot.events import EventType as T
    from skyspot.executors import executor_for

    now = now or time.time()
    events = log.events
    steps = [e["step"] for e in events if e.get("type") in (T.STEP, T.RESUME) and isinstance(e.get("step"), int)]
    attempts = split(events)
    started = [a for a in attempts if a.started]
    wheres = [a.where for a in started]
    # Where the newest attempt runs; an earlier attempt's placement fills what it does not say yet.
    where = dict(wheres[-1]) if wheres else {}
    for earlier in reversed(wheres[:-1]):
        for key, value in earlier.items():
            where.setdefault(key, value)
    durable = [
        e["step"]
        for e in events
        if e.get("type") == T.UPLOAD_END and e.get("durable") is True and isinstance(e.get("step"), int)
    ]
    committed = [e["step"] for e in events if e.get("type") == T.CHECKPOINT_END and isinstance(e.get("step"), int)]
    status = run.status
    recoveries = max(0, len(started) - 1)
    if queue_record:
        status = queue_record.get("status") or status
        recoveries = int(queue_record.get("recovery_count") or recoveries)
        where = {
            **where,
            "cloud": where.get("cloud") or queue_record.get("cloud"),
            "region": where.get("region") or queue_record.get("region"),
        }
    end = run.ended_at if run.terminal and run.ended_at else now
    try:
        cost = round(cost_so_far(log, now=end), 4) if events else 0.0
    except Exception:  # prices unknown for this instance: show no figure rather than fail the listing
        cost = None
    last_ckpt = max(durable) if durable else (max(committed) if committed else None)
    return {
        "name": run.name,
        "recipe": run.recipe,
        "executor": run.executor,
        "status": status,
        "cloud": where.get("cloud"),
        "region": where.get("region"),
        "spot": where.get("spot"),
        "instance_type": where.get("instance_type"),
        "step": max(steps) if steps else 0,
        "total_steps": run.total_steps,
        "recoveries": recoveries,
        # Restarts on the same machines (torchrun's agent, #26), apart from SkyPilot's recoveries onto new ones.
        "restarts_in_place": sum(a.in_place_restarts for a in attempts),
        "hangs": sum(len(a.hangs) for a in attempts),
        # Attempts that ended without completing, by cause (attempts.CAUSES); the running one is not counted.
        "interruptions": count_causes(a for a in attempts if not a.open),
        "last_checkpoint": last_ckpt,
        "last_checkpoint_durable": bool(durable) or not run.store,
        "elapsed_seconds": round(end - run.created_at, 1),
        "cost_so_far_usd": cost,
        "simulated": executor_for(run).simulated or any(is_simulated(w) for w in wheres),
        "job_id": run.job_id,
        "malformed_event_lines": log.malformed,
        "oversized_event_files": list(getattr(log, "oversized", [])),
        "unknown_event_types": dict(getattr(log, "unknown_types", {})),
        "cause": run.info.get("cause") if isinstance(run.info.get("cause"), str) else None,
        "deadline": _deadline(run, events),
        "node_kinds": node_kinds(events),  # what it ran on: one entry per distinct kind of node (node_kinds.py)
        "fabric": _fabric(started),  # the newest attempt's fabric probe (clouds/fabric_rates.py summarize)
        **latest_losses(log),
    }


def _fabric(started: Sequence[Any]) -> Optional[dict[str, Any]]:
    """The newest started attempt's fabric, as its nodes' `fabric` events recorded it (one per node)."""
    from skyspot.clouds.fabric_rates import summarize
    from skyspot.events import EventType as T

    for attempt in reversed(started):
        by_node: dict[Any, Mapping[str, Any]] = {}
        for e in attempt.events:
            if e.get("type") == T.FABRIC:
                by_node[e.get("node_rank")] = e  # the newest start's, after restarts in place
        if by_node:
            return summarize(by_node.values())
    return None


def latest_losses(log: EventLog) -> dict[str, Any]:
    """The newest train loss (a `step` event's) and eval loss (an `eval` event's), each with its step: what
    `logs` says after the log, and `status --json` carries. None where the run has none yet."""
    import math

    from skyspot.events import EventType

    def newest(type: EventType) -> Optional[Event]:
        return next(
            (
                e
                for e in reversed(log.events)
                if e.get("type") == type
                and isinstance(e.get("loss"), (int, float))
                and not isinstance(e.get("loss"), bool)
                and math.isfinite(e["loss"])
            ),
            None,
        )

    step, evaluation = newest(EventType.STEP), newest(EventType.EVAL)
    perplexity = evaluation.get("perplexity") if evaluation else None
    return {
        "train_loss": float(step["loss"]) if step else None,
        "train_loss_step": step.get("step") if step else None,
        "eval_loss": float(evaluation["loss"]) if evaluation else None,
        "eval_loss_step": evaluation.get("step") if evaluation else None,
        "eval_perplexity": float(perplexity)
        if isinstance(perplexity, (int, float)) and not isinstance(perplexity, bool) and math.isfinite(perplexity)
        else None,
    }


def _deadline(run: Run, events: Iterable[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A run launched with a deadline: its mode, projected finish and deadline (skyspot/planning/deadline.py)."""
    if not isinstance(run.info.get("deadline"), dict):
        return None
    from skyspot.planning.deadline import status_row

    return status_row(run.info["deadline"], events, ended_at=run.ended_at if run.terminal else None)


def deadline_text(deadline: Optional[Mapping[str, Any]]) -> Optional[str]:
    """`spot, ETA 14:02:10 <= due 15:00:00`, `waiting for spot ...`, or `met (due ...)` once it ended: a
    status row's deadline (summarize's `deadline`) in a few words (docs/deadline.md)."""
    if not deadline:
        return None
    from skyspot.planning.deadline import clock

    due = f"due {clock(deadline['at'])}"
    if deadline.get("met") is not None:
        return f"{'met' if deadline['met'] else 'MISSED'} ({due})"
    given: Optional[str] = deadline.get("mode")
    mode = ({"idle": "waiting for spot"}.get(given, given) if given else None) or "planning"
    if deadline.get("unreachable"):  # said as soon as the policy finds it (docs/deadline.md)
        mode = f"UNREACHABLE, {mode} to the end"
    eta = deadline.get("projected_finish")
    if eta is None:
        return f"{mode}, {due}"
    return f"{mode}, ETA {clock(eta)} {'<=' if eta <= deadline['at'] else '> LATE,'} {due}"
