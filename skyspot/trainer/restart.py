"""Restarts in place: what a worker generation that torchrun's agent restarted knows and decides.

torchrun restarts the workers itself (`--max-restarts`, the c10d rendezvous: task/render.py); this
module is what the restarted trainer does about it, once the ranks have a process group again:

- whether this start is a restart in place: global rank 0 keeps DIR/restarts.json (node 0's run
  directory) with the supervisor's token of this start (SKYSPOT_SUPERVISOR_TOKEN, one per start of
  the node, inherited by every generation of workers torchrun starts under it). Same token: this is
  generation k of the same attempt (same attempt number, no --fresh again); another token: a new start.
- what failed, when: each node leader reports its node's evidence since the previous generation
  began: the workers that died (DIR/worker_exits.json, kept by the node's supervisor, which sees every
  worker of its torchrun end, however it ends), the ranks that ended by an exception
  (DIR/failures/rank-R.json, written by the rank as it ends), and a hang the watchdog recorded
  (DIR/hang.json, at least {"ts", "step"}). Global rank 0 names the cause: "hang" if the watchdog
  recorded one; "crash" if a worker died without a word (SIGKILL, a segfault, the OOM killer) no later
  than TOLERANCE_S after the first exception (the supervisor sees a death within its poll period, a
  peer's exception follows it by milliseconds); "error" otherwise. failed_at is the earliest evidence.
- the budget: at most `resilience.restarts_in_place` restarts within any hour of the attempt, the k-th
  of them after `restart_backoff_seconds * 2**(k-1)` (at most BACKOFF_CAP_S). Past it, every rank ends
  with the error as a final ending (the exit record says 1, the process exits 0 so torchrun does not
  restart it: exit_codes.process_code), and the node's supervisor exits 1, which SkyPilot's
  `max_restarts_on_errors` recovers with new machines, as before in-place restarts existed.
- a preemption's ending is final: a generation that finds a node's exit record of the previous one
  saying 75 (a rank failed after the emergency checkpoint, so torchrun restarted them all) ends 75
  again at once, without training on a machine that is about to go.

The `restart_in_place` event is emitted by global rank 0 at the first completed step after the restart.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from skyspot.errors import SkyspotError
from skyspot.events import EventType as T

RECORD = "restarts.json"
WORKER_EXITS = "worker_exits.json"  # written by the node's supervisor (supervise.py)
FAILURES = "failures"
HANG_RECORD = "hang.json"  # written by the node's watchdog when it ends a hang
HOUR_S = 3600.0
BACKOFF_CAP_S = 300.0  # the recipe's own bound (recipe.py ResilienceSection.restart_backoff_seconds)
TOLERANCE_S = 1.0
KEEP_EXITS = 64


class RestartBudgetSpent(SkyspotError):
    """More failures within an hour than resilience.restarts_in_place allows: end the attempt (exit 1)."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    within_hour: int
    """This restart's number among the restarts of the last hour (1 for the first)."""
    wait_seconds: float


def decide(earlier: list[float], now: float, per_hour: int, backoff_s: float) -> Decision:
    """May the attempt restart in place now, given when its earlier restarts were, and after what wait?"""
    k = sum(1 for at in earlier if now - at < HOUR_S) + 1
    wait = min(BACKOFF_CAP_S, backoff_s * 2 ** (k - 1))
    return Decision(allowed=per_hour > 0 and k <= per_hour, within_hour=k, wait_seconds=wait)


# --------------------------------------------------------------------------- evidence on each node


def record_failure(run_dir: Path, rank: int, reason: str, failed_at: float) -> None:
    """A rank that ends by an exception says so (the restarted generation reads it); never raises."""
    from skyspot.trainer.exit_codes import TOKEN_ENV
    from skyspot.trainer.files import atomic_write_json

    try:
        path = Path(run_dir) / FAILURES / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_json(
            path,
            {
                "rank": rank,
                "pid": os.getpid(),
                "ts": failed_at,
                "reason": reason[:300],
                "token": os.environ.get(TOKEN_ENV),
            },
        )
    except OSError:
        pass


def _read(path: Path) -> Any:
    from skyspot.trainer.files import read_json

    return read_json(path)


def _stamped(item: Any, since: float) -> bool:
    return isinstance(item, dict) and isinstance(item.get("ts"), (int, float)) and item["ts"] >= since


def node_evidence(run_dir: Path, token: Optional[str], since: float) -> dict[str, Any]:
    """A node leader's view of how the previous generation ended on its node (since `since`)."""
    from skyspot.trainer.exit_codes import read_exit_record

    run_dir = Path(run_dir)
    exits = _read(run_dir / WORKER_EXITS)
    deaths = [
        e
        for e in (exits.get("exits") if isinstance(exits, dict) and exits.get("token") == token else []) or []
        if _stamped(e, since)
    ]
    failures = []
    for path in sorted((run_dir / FAILURES).glob("rank-*.json")):
        note = _read(path)
        if _stamped(note, since) and note.get("token") == token:
            failures.append(note)
    hang = _read(run_dir / HANG_RECORD)
    record = read_exit_record(run_dir, token=token, since=since)
    return {
        "deaths": deaths,
        "failures": failures,
        "hang": hang if _stamped(hang, since) else None,
        "code": record.get("code") if record and _stamped(record, since) else None,
    }


def diagnose(views: list[dict[str, Any]], fallback: float) -> tuple[str, float]:
    """(cause, failed_at) from every node's evidence; `fallback` when none says when."""
    hangs = [v["hang"]["ts"] for v in views if v.get("hang")]
    if hangs:
        return "hang", min(hangs)
    failures = [f for v in views for f in v.get("failures", [])]
    said = {f.get("pid") for f in failures}
    silent = [d["ts"] for v in views for d in v.get("deaths", []) if d.get("pid") not in said]
    first_error = min((f["ts"] for f in failures), default=None)
    first_silent = min(silent, default=None)
    if first_silent is not None and (first_error is None or first_silent <= first_error + TOLERANCE_S):
        return "crash", min(t for t in (first_silent, first_error) if t is not None)
    if first_error is not None:
        return "error", first_error
    return "crash", fallback


# --------------------------------------------------------------------------- the generation


@dataclass
class Generation:
    """This start of the workers within the node's start: 0 the first, k after k restarts in place."""

    restart: int = 0
    attempt: Optional[int] = None
    """The attempt a restart in place continues (None on the first generation: counted as every start)."""
    cause: Optional[str] = None
    failed_at: Optional[float] = None
    last_step: Optional[int] = None
    """The newest step the previous generation completed."""
    wait_seconds: float = 0.0
    within_hour: int = 0
    allowed: bool = True
    preempted: bool = False
    """A node's previous generation ended preempted (75): end so again."""
    pending: dict[str, Any] = field(default_factory=dict)
    """The event's fields still to fill at the first step (global rank 0)."""

    @property
    def in_place(self) -> bool:
        return self.restart > 0


def begin(run_dir: Path, placement, comm, resilience, say) -> Generation:
    """Collective, right after the process group exists: which generation this is, and what to do."""
    from skyspot.trainer.exit_codes import TOKEN_ENV

    token = os.environ.get(TOKEN_ENV) or None
    now = time.time()
    record = _read(Path(run_dir) / RECORD) if placement.is_global_zero else None
    same = bool(token) and isinstance(record, dict) and record.get("token") == token and bool(record.get("generations"))
    shared = (same, record["generations"][-1] if same else now) if placement.is_global_zero else None
    same, since = comm.all_gather_object(shared)[0]
    view = node_evidence(Path(run_dir), token, since) if same and placement.is_node_leader else None
    views = [v for v in comm.all_gather_object(view) if v is not None]
    gen = Generation()
    if placement.is_global_zero:
        if same:
            gen = _restarted(record, views, since, now, resilience, run_dir)
            if gen.allowed and not gen.preempted:
                record["generations"].append(now)
        else:
            record = {"token": token, "attempt": None, "generations": [now], "restarts": []}
        _write(Path(run_dir) / RECORD, record)
    gen = comm.all_gather_object(gen)[0]
    if gen.in_place and placement.is_global_zero:
        _say_restart(gen, resilience, say)
    return gen


def _restarted(record: dict, views: list[dict], since: float, now: float, resilience, run_dir: Path) -> Generation:
    from skyspot.trainer.exit_codes import PREEMPTED

    earlier = [r.get("at", 0.0) for r in record.get("restarts", [])]
    cause, failed_at = diagnose(views, fallback=since)
    decision = decide(earlier, now, resilience.restarts_in_place, resilience.restart_backoff_seconds)
    gen = Generation(
        restart=len(earlier) + 1,
        attempt=record.get("attempt"),
        cause=cause,
        failed_at=failed_at,
        last_step=_last_step(Path(run_dir), record.get("attempt"), since),
        wait_seconds=decision.wait_seconds if decision.allowed else 0.0,
        within_hour=decision.within_hour,
        allowed=decision.allowed,
        preempted=any(v.get("code") == PREEMPTED for v in views),
    )
    if decision.allowed and not gen.preempted:
        record.setdefault("restarts", []).append(
            {"restart": gen.restart, "at": now, "cause": cause, "failed_at": failed_at, "last_step": gen.last_step}
        )
    return gen


def _last_step(run_dir: Path, attempt: Optional[int], since: float) -> Optional[int]:
    """The newest step global rank 0's previous generation completed (its events of this attempt)."""
    from skyspot.events import read_events_dir

    if attempt is None:
        return None
    steps = [
        e.get("step")
        for e in read_events_dir(run_dir / "events").events
        if e.get("attempt") == attempt
        and e.get("rank") == 0
        and e.get("type") == T.STEP
        and isinstance(e.get("ts"), (int, float))
        and e["ts"] >= since
        and isinstance(e.get("step"), int)
    ]
    return max(steps) if steps else None


def _say_restart(gen: Generation, resilience, say) -> None:
    ago = time.time() - gen.failed_at if gen.failed_at else None
    what = (
        f"a {gen.cause}"
        + (f" {ago:.1f} s ago" if ago is not None else "")
        + (f" after step {gen.last_step}" if gen.last_step is not None else "")
    )
    if gen.preempted:
        say(f"restart in place after {what}: the previous workers ended preempted (75); ending so again")
    elif not gen.allowed:
        say(
            f"{what}: the in-place budget is spent ({gen.within_hour} failures within the hour, "
            f"resilience.restarts_in_place={resilience.restarts_in_place}); ending the attempt with the error "
            "so the cluster is recovered on new machines"
        )
    else:
        say(
            f"restart in place {gen.restart} ({gen.within_hour}/{resilience.restarts_in_place} this hour) after "
            f"{what}: every rank resumes from the newest committed local checkpoint"
            + (f" after a {gen.wait_seconds:g} s backoff" if gen.wait_seconds else "")
        )


def record_attempt(run_dir: Path, attempt: int) -> None:
    """Global rank 0 of the first generation: the attempt its restarts in place continue."""
    path = Path(run_dir) / RECORD
    record = _read(path)
    if isinstance(record, dict) and record.get("attempt") is None:
        record["attempt"] = attempt
        _write(path, record)


def settle(gen: Generation) -> None:
    """Every rank: end as the decision says (preempted again, or the budget spent), else wait the backoff."""
    from skyspot.trainer.exit_codes import Preempted

    if gen.preempted:
        raise Preempted(
            gen.last_step or 0,
            "preempted: the previous workers of this start ended preempted (75) "
            "after their emergency checkpoint; not restarted in place",
        )
    if not gen.allowed:
        raise RestartBudgetSpent(
            f"in-place restart budget spent: {gen.within_hour} failures within an hour "
            f"(the last a {gen.cause}); ending the attempt so it is recovered on new machines"
        )
    if gen.wait_seconds > 0:
        time.sleep(gen.wait_seconds)


def resumed(gen: Generation, step: int) -> None:
    """Global rank 0 once the resume point is known: the event's fields but the time to the next step."""
    if gen.in_place:
        steps_redone = max(0, gen.last_step - step) if gen.last_step is not None else 0
        gen.pending = {
            "cause": gen.cause,
            "failed_at": gen.failed_at,
            "steps_redone": steps_redone,
            "restart": gen.restart,
            "step": step,
        }


def first_step(gen: Optional[Generation], emit, say) -> None:
    """Global rank 0 after the first step of a restarted generation: the `restart_in_place` event."""
    if gen is None or not gen.pending:
        return
    fields, gen.pending = gen.pending, {}
    seconds = round(time.time() - fields["failed_at"], 3) if fields.get("failed_at") else None
    emit("restart_in_place", seconds_to_next_step=seconds, **fields)
    say(
        f"back to training {seconds} s after the {fields['cause']} (restart in place {fields['restart']}, "
        f"{fields['steps_redone']} step(s) redone from step {fields['step']})"
    )


def _write(path: Path, record: dict) -> None:
    from skyspot.trainer.files import atomic_write_json

    try:
        atomic_write_json(path, record)
    except OSError:
        pass


# --------------------------------------------------------------------------- the supervisor's side


def note_worker_exit(run_dir: Path, token: str, exit: dict[str, Any]) -> None:
    """The supervisor: one of its torchrun's workers ended (appended to DIR/worker_exits.json)."""
    path = Path(run_dir) / WORKER_EXITS
    record = _read(path)
    exits = record.get("exits", []) if isinstance(record, dict) and record.get("token") == token else []
    _write(path, {"token": token, "exits": (exits + [exit])[-KEEP_EXITS:]})
