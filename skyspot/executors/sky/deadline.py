"""The run's controller on SkyPilot, for a deadline or a supervised run (`resources.supervise`): a small
controller, itself a managed job, that runs the training as stages under the run's one name
(docs/deadline.md and docs/planning.md, "Recoveries on a cloud", say why this mechanism).

    python -m skyspot.executors.sky.deadline /skyspot/deadline/plan.json      (on the controller's node)

`launch` (skyspot/executors/sky/submit.py) submits `controller_task(...)`: one cheap on-demand CPU
node, restarted by SkyPilot on errors, that installs the skyspot wheel without the training stack
and runs `main()`. The controller then runs the training as *stages*, each a managed job named like
the run: with a deadline, the run's rendered task restricted to one capacity (`stage_task`: spot
candidates only, or on-demand candidates only); without one, the task as rendered (`ANY`). Every
stage's node has the same SKYSPOT_RUN_NAME, so it resumes from the newest durable checkpoint under
`<store>/<run>/`. Every `period` seconds it reads the stage's status from SkyPilot's queue (and, with
a deadline, the run's events from the store) and decides (skyspot/planning/deadline.py):

- spot stage RUNNING: on spot (it stays, unless the safety net commits to on-demand);
- spot stage PENDING, STARTING or RECOVERING: a changeover, until it has waited longer than a
  restart; then "idle, no spot capacity" (SkyPilot keeps retrying spot meanwhile, for free);
- on-demand stage: on on-demand, until the policy wants spot again.

While a stage is not RUNNING yet (SkyPilot provisions its node and runs the task's setup), what is left
of a restart counts from now (`State.overhead_left`), and a round also falls at the deadline itself:
a deadline lost while a node is prepared is said then (`deadline UNREACHABLE: ...` in this job's log,
which an attached `launch` streams; `status` from the decision event), not once the stage runs.

Every stage that replaces another waits for a handover (trainer/handover.py): a switch while the stage
trains launches the next one beside it (`next`, make-before-break) and hands over once SkyPilot runs it;
the stage replaced is recorded as `retiring`, cancelled (SkyPilot's cancel sends the run SIGTERM: the
trainer writes an emergency checkpoint), and the handover is written only once SkyPilot reports it
ended. A spot stage SkyPilot starts recovering is relaunched with its region moved back by expected cost
when that moves it (relaunch.py); a supervised stage on on-demand goes back to spot when the rest of the
run pays (planning/return_to_spot.py). Each decision is an event in
`<store>/<run>/events/deadline.controller.jsonl` (`deadline_decision`, or `placement_decision` without a
deadline), with the stages' job ids, so a restarted controller picks up where it was. Cancelled itself
(`skyspot cancel RUN`), it cancels its stages.

The controller needs SkyPilot's API server from inside a managed job: SkyPilot 0.14 injects the
endpoint and a service-account token into managed jobs (`api_server_access`, on by default) when
the API server is remote; `launch` refuses a deadline on a local API server (`check_api_server`).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from skyspot.planning import deadline as dl
from skyspot.errors import EXIT_USAGE, SkyspotError, UsageError
from skyspot.executors.sky import relaunch, sdk as sky_executor

if TYPE_CHECKING:
    from skyspot.planning.return_to_spot import Payoff
from skyspot.events import EventType
from skyspot.statuses import RunStatus, has_ended
from skyspot.trainer.handover import TOKEN

CONTROLLER_MOUNT = "/skyspot/deadline"
PLAN_FILE = "plan.json"
DECISIONS_FILE = "deadline.controller.jsonl"
PLACEMENT_EVENT = EventType.PLACEMENT_DECISION.value
ENDED_REASONS = frozenset({"done", "stage-ended", "cancelled"})
"""The controller's last event of a run that ended: a resumed run's controller starts with no stage."""
"""A supervised run's controller events (no deadline): a stage launched, or relaunched away from a place."""
PERIOD_SECONDS = 60.0
# What SkyPilot spends before the trainer starts on a new node (provisioning, then the task's
# setup), until this run has measured its own restarts; the whole restart prior is in planning/deadline.py.
CLOUD_PROVISION_SECONDS = 600.0
CANCEL_WAIT_SECONDS = 900.0
# The controller's own node: the cheapest CPU VM SkyPilot finds, never spot (it must outlive them).
CONTROLLER_RESOURCES = {"cpus": "2+", "memory": "4+", "use_spot": False, "disk_size": 50}
# What the controller imports beyond skyspot itself (the SkyPilot client; the store's SDKs).
CONTROLLER_PACKAGES = ("pyyaml", "pydantic", "typer", "rich", "boto3", "google-cloud-storage", "azure-storage-blob")
WAITING = {RunStatus.PENDING, RunStatus.SUBMITTED, RunStatus.STARTING, RunStatus.RECOVERING}


# --------------------------------------------------------------------------- launch side


def check_api_server() -> None:
    """A deadline's controller launches stages from inside a managed job: SkyPilot's API server must be
    one its jobs can reach (a remote one), not a server on this machine."""
    from sky.server import common as server_common

    endpoint = server_common.get_server_url()
    if server_common.is_api_server_local(endpoint):
        raise UsageError(
            f"a deadline or a supervised run (resources.supervise) on a cloud needs a SkyPilot API server "
            f"that managed jobs can reach: its controller runs as a managed job and launches the training "
            f"through it, and this API server is local ({endpoint}). Deploy a remote API server "
            "(docs.skypilot.co, 'API server deployment') and `sky api login`, or launch without --deadline "
            "and resources.supervise"
        )


def stage_task(task: dict[str, Any], *, spot: bool) -> dict[str, Any]:
    """The run's rendered task on one capacity: its spot candidates only, or its on-demand ones (the
    spot candidates on demand if the recipe had none), in the plan's order."""
    stage = copy.deepcopy(task)
    resources = stage.setdefault("resources", {})
    key = "ordered" if "ordered" in resources else ("any_of" if "any_of" in resources else None)
    if key is None:
        resources["use_spot"] = spot
        return stage
    candidates = resources[key]
    mine = [c for c in candidates if bool(c.get("use_spot")) == spot]
    if not mine:
        mine = []
        for c in candidates:
            flipped = {**c, "use_spot": spot}
            if flipped not in mine:
                mine.append(flipped)
    resources[key] = mine
    return stage


def controller_task(task: dict[str, Any], plan: dict[str, Any], *, clouds: list[str], package) -> dict[str, Any]:
    """The controller's managed-job task. `task` is the run's rendered task (its local file mounts are
    mounted on the controller too, at the same paths, so the stages it launches can name them);
    `plan` is written to `<plan_dir>/plan.json` by `write_plan`, mounted at CONTROLLER_MOUNT."""
    from skyspot.task.package import PACKAGE_MOUNT

    mounts = {
        target: source
        for target, source in (task.get("file_mounts") or {}).items()
        if isinstance(source, str) and "://" not in source
    }
    mounts[CONTROLLER_MOUNT] = plan["plan_dir"]
    envs = {k: v for k, v in (task.get("envs") or {}).items() if k in ("SKYSPOT_RUN_NAME", "SKYSPOT_PACKAGE_DIR")}
    envs.setdefault("SKYSPOT_PACKAGE_DIR", PACKAGE_MOUNT)
    return {
        "name": plan["run"],
        "resources": {
            **CONTROLLER_RESOURCES,
            "any_of": [{"cloud": c} for c in clouds],
            "job_recovery": {"max_restarts_on_errors": 3},
        },
        "envs": envs,
        **({"secrets": dict(task["secrets"])} if task.get("secrets") else {}),
        "file_mounts": mounts,
        "setup": "set -e\n"
        'python -m pip install --quiet --no-deps "$SKYSPOT_PACKAGE_DIR"/skyspot-*.whl\n'
        f"python -m pip install --quiet {' '.join(_quoted(controller_requirements(package)))}\n",
        "run": f"exec python -m skyspot.executors.sky.deadline {CONTROLLER_MOUNT}/{PLAN_FILE}\n",
    }


def controller_requirements(package) -> list[str]:
    """The controller's stack, pinned like the nodes' (task/package.py): the SkyPilot client and the stores' SDKs."""
    import re
    from importlib import metadata

    wanted = {re.sub(r"[-_.]+", "-", n).lower() for n in CONTROLLER_PACKAGES}
    pins = [
        r
        for r in (package.requirements if package else ())
        if re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]).lower() in wanted
    ]
    try:
        pins.append(f"skypilot=={metadata.version('skypilot')}")
    except metadata.PackageNotFoundError:
        pins.append("skypilot")
    return pins


def _quoted(items: list[str]) -> list[str]:
    import shlex

    return [shlex.quote(i) for i in items]


def write_plan(home_dir, plan: dict[str, Any]) -> str:
    """Write the controller's plan where the task mounts it from; returns that folder."""
    from pathlib import Path

    folder = Path(home_dir) / "deadline" / plan["run"]
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    plan = {**plan, "plan_dir": str(folder)}
    path = folder / PLAN_FILE
    tmp = folder / f".{PLAN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(plan, indent=2, sort_keys=True))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return str(folder)


def plan_for(
    task: dict[str, Any],
    *,
    run: str,
    store: str,
    deadline: Optional[dict[str, Any]],
    total_steps: int,
    recipe: str,
    burst_seconds: float = 0.0,
) -> dict[str, Any]:
    """What the controller needs: the run, its store, its deadline (None: it only supervises), how long a
    preemption counts against its region (`burst_seconds`, resources.burst_minutes; 0: never), and the stages' task,
    whose local mounts point at the controller's copies (the same paths)."""
    stage = copy.deepcopy(task)
    mounts = stage.get("file_mounts") or {}
    for target, source in list(mounts.items()):
        if isinstance(source, str) and "://" not in source:
            mounts[target] = target  # mounted on the controller at the same path
    return {
        "run": run,
        "store": store,
        "deadline": dict(deadline) if deadline else None,
        "burst_seconds": float(burst_seconds),
        "total_steps": total_steps,
        "recipe": recipe,
        "task": stage,
    }


# --------------------------------------------------------------------------- the controller


def _token() -> str:
    """A new stage's handover token (SKYSPOT_HANDOVER): unique, and a valid object name (trainer/handover.py)."""
    import secrets

    return f"stage-{secrets.token_hex(8)}"


ANY = "any"
"""A supervised run's stage without a deadline: the whole task, spot first then on-demand, as rendered."""


@dataclass
class Stage:
    job_id: int
    mode: str
    launched_at: float
    waiting_since: Optional[float] = None
    """Since when it has not been RUNNING (launched, or preempted and recovering); None while it runs."""
    where: Optional[dict[str, Any]] = None
    """Where SkyPilot last reported it RUNNING (cloud, region, zone, spot): the place a recovery leaves."""
    handover: Optional[str] = None
    """The token its nodes wait for before they start (SKYSPOT_HANDOVER, trainer/handover.py): a stage launched
    make-before-break while another one trained."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "mode": self.mode,
            "launched_at": self.launched_at,
            "waiting_since": self.waiting_since,
            "where": self.where,
            "handover": self.handover,
        }

    @classmethod
    def from_dict(cls, data: Any, ts: float) -> Optional["Stage"]:
        if not isinstance(data, dict) or not isinstance(data.get("job_id"), int):
            return None
        return cls(
            data["job_id"],
            data["mode"],
            float(data.get("launched_at") or ts),
            data.get("waiting_since"),
            data.get("where") if isinstance(data.get("where"), dict) else None,
            data["handover"] if isinstance(data.get("handover"), str) and TOKEN.match(data["handover"]) else None,
        )


class CloudController:
    """The deadline's control loop on SkyPilot (see the module docstring). `clock` and `sleep` are
    injectable for tests; SkyPilot is reached through executors/sky/sdk.py only."""

    def __init__(
        self,
        plan: dict[str, Any],
        *,
        store=None,
        environ=os.environ,
        clock: Callable[[], float] = time.time,
        sleep: Optional[Callable[[float], bool]] = None,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ):
        from skyspot.storage import open_store

        self.plan = plan
        self.run = plan["run"]
        self.store = store if store is not None else open_store(plan["store"])
        self.environ = environ
        self.clock = clock
        self.stop_requested = threading.Event()
        self._sleep = sleep
        self.say = say
        d = plan.get("deadline")
        self.deadline: Optional[dict[str, Any]] = d if isinstance(d, dict) else None
        self.at = float(d["at"]) if self.deadline else None
        self.policy = (d or {}).get("policy") or dl.DEFAULT_POLICY
        self.period = float((d or {}).get("period") or PERIOD_SECONDS)
        self.burst_seconds = float(plan.get("burst_seconds") or 0.0)
        # What a preemption costs the run, for the relaunch's expected costs: the planner's prior (15 min of
        # provisioning, setup and start-up on every node); a deadline's measured restarts are not used here.
        self.restart_seconds = dl.CLOUD_RESTART_PRIOR_SECONDS
        self.losses: list[relaunch.Loss] = []
        """Where and when spot stages were preempted, as long as they count (executors/sky/relaunch.py)."""
        self.committed = False
        self.last: Optional[dl.Decision] = None
        self.stage: Optional[Stage] = None
        self.next: Optional[Stage] = None
        """The next stage, launched while `stage` trains and made ready by SkyPilot (make-before-break)."""
        self.retiring: Optional[Stage] = None
        """The stage `stage` replaced, cancelled and not yet reported ended by SkyPilot: only once it ended is
        the handover its successor's nodes wait for written (trainer/handover.py). Kept in the events, so an
        error or a restart in between never reads its CANCELLED as the run's end."""
        self.failed_next_at: Optional[float] = None
        """When a next stage last ended before it was ready: no other is launched for a restart's time."""
        self.declined: set[int] = set()
        """Supervised runs: the on-demand stages whose way back to spot did not pay (said once each)."""
        self.lines: list[str] = []
        self._restore()

    # ------------------------------------------------------------------ state kept in the store
    def _key(self) -> str:
        from skyspot.events import EVENTS_DIR
        from skyspot.storage import join_key

        return join_key(self.run, EVENTS_DIR, DECISIONS_FILE)

    def _restore(self) -> None:
        """A controller restarted by SkyPilot continues with the stage its predecessor launched."""
        data = self.store.get_bytes(self._key()) or b""
        self.lines = [line for line in data.decode("utf-8", errors="replace").split("\n") if line.strip()]
        for line in reversed(self.lines):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("type") not in (dl.DECISION_EVENT, PLACEMENT_EVENT):
                continue
            losses = event.get("losses")
            self.losses = [p for p in (relaunch.Loss.from_dict(x) for x in losses or []) if p is not None]
            self.committed = bool(event.get("committed"))
            if event.get("reason") in ENDED_REASONS:
                break  # a resumed run's controller: its last stage ended with it; it starts a new one
            self.stage = Stage.from_dict(event.get("stage"), event["ts"])
            self.next = Stage.from_dict(event.get("next"), event["ts"])
            self.retiring = Stage.from_dict(event.get("retiring"), event["ts"])
            break

    def _emit(self, **fields: Any) -> None:
        stage = None if self.stage is None else self.stage.as_dict()
        event = {
            "ts": self.clock(),
            "run_id": self.run,
            "attempt": 0,
            "node_rank": 0,
            "rank": None,
            "type": dl.DECISION_EVENT if self.deadline else PLACEMENT_EVENT,
            "stage": stage,
            **({"next": self.next.as_dict()} if self.next is not None else {}),
            **({"retiring": self.retiring.as_dict()} if self.retiring is not None else {}),
            **({"committed": self.committed} if self.deadline else {}),
            "losses": [p.as_dict() for p in relaunch.recent(self.losses, self.clock(), self.burst_seconds)],
            **({"deadline": self.at} if self.at is not None else {}),
            **fields,
        }
        self.lines.append(json.dumps(event, separators=(",", ":"), default=str))
        self.store.put_bytes(self._key(), ("\n".join(self.lines) + "\n").encode("utf-8"))

    # ------------------------------------------------------------------ one round
    def step(self) -> Optional[int]:
        """One decision; returns the controller's exit code once the run has ended."""
        now = self.clock()
        if self.retiring is not None and not self._retired(now):
            return None  # the stage replaced has not ended yet: asked again next round
        status = None
        if self.stage is not None:
            record = sky_executor.queue([self.stage.job_id]).get(self.stage.job_id) or {}
            status = str(record.get("status") or "PENDING")
            if has_ended(status):
                self._withdraw(f"stage {self.stage.job_id} ended {status}")
            if status == "SUCCEEDED":
                met = {"deadline": self.at, "met": now <= self.at} if self.at is not None else {}
                self._emit(mode=dl.IDLE, reason="done", why="the run finished", **met)
                self.say(
                    f"run finished {'before' if now <= self.at else 'AFTER'} its deadline {dl.when(self.at)}"
                    if self.at is not None
                    else "run finished"
                )
                return 0
            if has_ended(status):
                self._emit(mode=dl.IDLE, reason="stage-ended", why=f"stage {self.stage.job_id} ended {status}")
                self.say(f"stage {self.stage.job_id} ({self.stage.mode}) ended {status}; the run stops here")
                return 1
            if status == "RUNNING":
                self.stage.waiting_since = None
                where = sky_executor.where_from_queue(record)
                if where.get("region"):
                    self.stage.where = where
            elif self.stage.waiting_since is None:
                self.stage.waiting_since = now  # preempted: SkyPilot is recovering it
            if status == "RECOVERING" and self._leaves(self.stage):
                loss = self._count_loss(self.stage, now)
                if self.next is None:
                    self._leave(self.stage, loss, now)
                    return None
            if self.next is not None and self._handed_over(status, now):
                return None
        if self.deadline is None:
            if self.stage is None:
                self.stage = self._launch(ANY)
                self._emit(mode=ANY, reason="start", why="supervised run: the task as rendered")
                self.say(f"supervising: stage {self.stage.job_id} launched")
            elif self.next is None:
                self._supervise(now, status)
            return None
        return self._decide(now, status)

    def _supervise(self, now: float, status: Optional[str]) -> None:
        """A supervised run without a deadline: the way back to spot, make-before-break. A stage that
        SkyPilot runs on on-demand (its fallback) gets a spot stage made ready beside it when the rest of the
        run pays for the switch (planning/return_to_spot.py); a spot stage that cannot get capacity back
        within a restart goes back to the task as rendered (spot first, then on-demand)."""
        stage = self.stage
        assert stage is not None
        if stage.mode == dl.SPOT:
            waited = now - (stage.waiting_since or now)
            if status != "RUNNING" and waited > self.restart_seconds:
                self.say(
                    f"stage {stage.job_id} (spot) has had no spot capacity for {waited:.0f}s: the task as rendered "
                    "again (on-demand after spot)"
                )
                self._switch_to(
                    self._launch(ANY, handover=_token()), reason="spot-gone", why=f"no spot capacity for {waited:.0f}s"
                )
            return
        where = stage.where or {}
        if status != "RUNNING" or where.get("spot") is not False or stage.job_id in self.declined:
            return
        if self.failed_next_at is not None and now - self.failed_next_at < self.restart_seconds:
            return
        payoff = self._spot_payoff(where)
        if payoff is None:
            return
        if not payoff.pays:
            self.declined.add(stage.job_id)
            self.say(f"stage {stage.job_id} runs on on-demand; going back to spot does not pay: {payoff.why}")
            self._emit(mode=ANY, reason="spot-declined", why=payoff.why)
            return
        self.next = self._launch(dl.SPOT, handover=_token())
        self.say(
            f"stage {stage.job_id} runs on on-demand: stage {self.next.job_id} on spot is made ready while it trains "
            f"(make-before-break; it pays: {payoff.why})"
        )
        self._emit(mode=ANY, reason="spot-back", why=payoff.why)

    def _spot_payoff(self, where: dict[str, Any]) -> Optional["Payoff"]:
        """Whether the rest of the run pays for going back to spot from the on-demand place `where`; None while
        the run has measured no step or the snapshot has no price for the place."""
        from skyspot.events import read_events_store
        from skyspot.planning.return_to_spot import switch_pays
        from skyspot.planning.spot_risk import rate_for
        from skyspot.pricing import prices as pricing

        events = read_events_store(self.store, self.run).events
        estimates = dl.measure(
            events, provision_seconds=CLOUD_PROVISION_SECONDS, restart_prior=dl.CLOUD_RESTART_PRIOR_SECONDS
        )
        step_s, done = estimates.step(dl.ON_DEMAND), dl.progress(events)
        cloud, itype = str(where.get("cloud") or ""), where.get("instance_type")
        if not step_s or not done or not cloud or not itype:
            return None
        nodes = int(where.get("num_nodes") or 1)
        try:
            on_demand = pricing.hourly_price(cloud, instance_type=itype, region=where.get("region"), spot=False)
            spot = pricing.hourly_price(cloud, instance_type=itype, spot=True)  # SkyPilot's spot stage: cheapest region
        except SkyspotError:
            return None
        risk = rate_for(None, cloud, region=None, instance_type=itype, spot=True, accelerator=where.get("accelerators"))
        return switch_pays(
            remaining_s=max(0, int(self.plan["total_steps"]) - done) * step_s,
            on_demand_usd_h=on_demand.usd_per_hour * nodes,
            spot_usd_h=spot.usd_per_hour * nodes,
            provision_s=CLOUD_PROVISION_SECONDS,
            start_s=max(0.0, estimates.restart_seconds - CLOUD_PROVISION_SECONDS),
            rate_per_s=risk.per_node_hour * nodes / 3600,
        )

    def _leaves(self, stage: Stage) -> bool:
        """Whether a stage SkyPilot is recovering was preempted on spot in a place it reported (and the recipe
        counts preemptions: resources.burst_minutes > 0). Once per preemption: the place is then forgotten
        until SkyPilot reports the stage RUNNING again."""
        where = stage.where or {}
        return (
            self.burst_seconds > 0
            and stage.mode != dl.ON_DEMAND
            and bool(where.get("spot"))
            and bool(where.get("region"))
        )

    def _count_loss(self, stage: Stage, now: float) -> relaunch.Loss:
        """A spot stage SkyPilot started recovering: its preemption counts against its region (once: its place
        is forgotten until SkyPilot reports it RUNNING again)."""
        where = stage.where or {}
        loss = relaunch.Loss(str(where.get("cloud") or "").lower(), str(where["region"]), where.get("zone"), now)
        self.losses = relaunch.recent(self.losses, now, self.burst_seconds) + [loss]
        stage.where = None
        return loss

    def _leave(self, stage: Stage, loss: relaunch.Loss, now: float) -> None:
        """SkyPilot is recovering a spot stage, in the region it lost (FAILOVER) or wherever is cheapest
        (EAGER_NEXT_REGION, which blocks nothing in 0.14.1). If the next stage's candidates by expected cost move
        a preempted region back (executors/sky/relaunch.py), launch that stage, its nodes waiting for the
        handover, and cancel this one; else SkyPilot's recovery goes where it pays anyway."""
        place = f"{loss.cloud}/{loss.region}" + (f" ({loss.zone})" if loss.zone else "")
        plan = relaunch.relaunch_plan(
            self._task_for(stage.mode), self.losses, now=now, burst_s=self.burst_seconds, restart_s=self.restart_seconds
        )
        if not plan.leaves:
            self.say(f"stage {stage.job_id} preempted in {place}: SkyPilot recovers it ({plan.why})")
            self._emit(mode=stage.mode, reason="stays", why=f"preempted in {place}; {plan.why}")
            return
        self.say(f"stage {stage.job_id} preempted in {place}: relaunching: {plan.why}")
        self._switch_to(
            self._launch(stage.mode, handover=_token()), reason="left", why=f"preempted in {place}; {plan.why}"
        )

    def _decide(self, now: float, status: Optional[str]) -> Optional[int]:
        """A deadline's round: the policy's decision, and the switch it asks for."""
        from skyspot.events import read_events_store

        assert self.deadline is not None and self.at is not None
        log = read_events_store(self.store, self.run)
        estimates = dl.estimates_for(
            log.events,
            self.deadline,
            provision_seconds=CLOUD_PROVISION_SECONDS,
            restart_prior=dl.CLOUD_RESTART_PRIOR_SECONDS,
        )
        mode, spot_available = self._mode(status, now, estimates.restart_seconds)
        round_ = dl.next_round(
            self.policy,
            log.events,
            estimates,
            now=now,
            plan=self.deadline,
            total_steps=int(self.plan["total_steps"]),
            mode=mode,
            spot_available=spot_available,
            committed=self.committed,
            margin=self.period,
            overhead_left=self._changeover_left(status, now, estimates.restart_seconds),
        )
        decision = round_.decision
        self.committed = decision.committed
        line = dl.news(self.last, decision, self.at)
        if line and decision.reason == dl.UNREACHABLE:
            self.say(line)  # at once; other changes of mind are said where they act (_act)
        self.last = decision
        self._act(decision, mode)
        self._emit(**round_.event_fields())
        return None

    def _mode(self, status: Optional[str], now: float, restart_seconds: float) -> tuple[str, Optional[bool]]:
        if self.stage is None:
            return dl.IDLE, None
        if self.stage.mode == dl.ON_DEMAND:
            return dl.ON_DEMAND, None
        if status == "RUNNING":
            return dl.SPOT, None
        # A spot stage not running: its changeover, until it has waited longer than a restart.
        if now - (self.stage.waiting_since or self.stage.launched_at) <= restart_seconds:
            return dl.SPOT, None
        return dl.IDLE, False

    def _changeover_left(self, status: Optional[str], now: float, restart_seconds: float) -> float:
        """What is left of a stage's changeover while SkyPilot provisions it and runs its setup (not RUNNING
        yet): a restart's worth from when it began waiting, so a deadline lost meanwhile is found then."""
        if self.stage is None or status == "RUNNING":
            return 0.0
        return max(0.0, restart_seconds - (now - (self.stage.waiting_since or self.stage.launched_at)))

    def pause(self) -> float:
        """Seconds to the next round: a period, or until the deadline if it falls first (a deadline that
        passes is said when it passes)."""
        now = self.clock()
        return min(self.period, self.at - now) if self.at is not None and now < self.at else self.period

    def _act(self, decision: dl.Decision, mode: str) -> None:
        want = decision.mode
        if want == dl.IDLE and decision.reason == "done":
            return
        if want == dl.IDLE:
            want = dl.SPOT  # waiting for spot is a pending spot stage: SkyPilot retries it
        if self.next is not None:
            if self.next.mode != want:
                self._withdraw(f"the policy wants {want} again: {decision.why}")
            return
        if self.stage is not None and self.stage.mode == want:
            return
        if self.stage is not None and self.stage.waiting_since is None:
            # Make-before-break: the stage trains on while SkyPilot provisions the next and runs its setup; the
            # next one's nodes wait for the handover (trainer/handover.py), written once this one stopped.
            if self.failed_next_at is not None and self.clock() - self.failed_next_at < self.restart_seconds:
                return  # the last one failed before it was ready: not another every round
            self.next = self._launch(want, handover=_token())
            self.say(
                f"deadline: leaving {self.stage.mode} for {want}: {decision.why}; stage {self.next.job_id} on {want} "
                f"is made ready while stage {self.stage.job_id} trains (make-before-break)"
            )
            return
        if self.stage is None:
            self.stage = self._launch(want)
        else:  # nothing trains: the next stage at once, its nodes waiting until this one ended
            self.say(f"deadline: leaving {self.stage.mode} for {want}: {decision.why}")
            self._switch_to(self._launch(want, handover=_token()), reason="switch", why=decision.why)
        self.say(
            f"deadline: stage {self.stage.job_id} on {want} ({decision.reason}); projected finish "
            f"{dl.when(decision.projected_finish)}, deadline {dl.when(self.at)}"
        )

    def _handed_over(self, status: Optional[str], now: float) -> bool:
        """A next stage being made ready: hand over once SkyPilot runs it (its setup done, its nodes waiting),
        or at once if the stage it replaces stopped training (preempted: nothing to keep); True once it did."""
        assert self.next is not None and self.stage is not None
        record = sky_executor.queue([self.next.job_id]).get(self.next.job_id) or {}
        ready = str(record.get("status") or "PENDING")
        if has_ended(ready):
            failed = self.next
            self.say(
                f"switch: stage {failed.job_id} ({failed.mode}) ended {ready} before it was ready; stage "
                f"{self.stage.job_id} goes on, and no other is made ready for {self.restart_seconds:.0f}s"
            )
            self.next, self.failed_next_at = None, now
            self._emit(mode=self.stage.mode, reason="next-failed", why=f"stage {failed.job_id} ended {ready}")
            return False
        if ready != "RUNNING" and status == "RUNNING":
            return False
        old, new = self.stage, self.next
        self.say(
            f"switch: stage {new.job_id} ({new.mode}) is ready: stage {old.job_id} ({old.mode}) checkpoints and stops"
            if ready == "RUNNING"
            else f"switch: stage {old.job_id} stopped training ({status}): stage {new.job_id} ({new.mode}) takes over"
        )
        new.waiting_since = None if ready == "RUNNING" else now
        self._switch_to(new, reason="handover", why=f"stage {new.job_id} takes over from stage {old.job_id}")
        return True

    def _switch_to(self, new: Stage, *, reason: str, why: str) -> None:
        """`new` replaces the current stage: recorded first (the current one as retiring), then the current one
        is cancelled, and the handover `new`'s nodes wait for is written once SkyPilot reports it ended."""
        old = self.stage
        self.stage, self.next, self.retiring = new, None, old
        self._emit(mode=new.mode, reason=reason, why=why, previous_job_id=old.job_id if old else None)
        if old is not None:
            self._retired(self.clock())

    def _retired(self, now: float) -> bool:
        """The stage replaced has ended (cancelled now if it had not): write its successor's handover. False
        while SkyPilot still reports it alive (its emergency checkpoint, its teardown): asked again next round."""
        from skyspot.trainer.handover import handover_key

        old = self.retiring
        assert old is not None
        if not self._cancel(old):
            return False
        new = self.stage
        if new is not None and new.handover is not None:
            self.store.put_bytes(
                handover_key(self.run, new.handover),
                json.dumps({"from_job_id": old.job_id, "to_job_id": new.job_id, "ts": self.clock()}).encode("utf-8"),
            )
        self.retiring = None
        self._emit(
            mode=new.mode if new else dl.IDLE,
            reason="handed-over",
            why=f"stage {old.job_id} ended" + (f"; stage {new.job_id} starts" if new else ""),
            previous_job_id=old.job_id,
        )
        return True

    def _withdraw(self, why: str) -> None:
        """Cancel the next stage being made ready (the switch is off)."""
        if self.next is None:
            return
        self.say(f"switch: the switch to {self.next.mode} is withdrawn ({why}); stage {self.next.job_id} cancelled")
        try:
            sky_executor.cancel(self.next.job_id)
        except SkyspotError as error:
            self.say(f"could not cancel stage {self.next.job_id}: {error}")
        self.next = None

    def _task_for(self, mode: str) -> dict[str, Any]:
        return self.plan["task"] if mode == ANY else stage_task(self.plan["task"], spot=mode == dl.SPOT)

    def _launch(self, mode: str, *, handover: Optional[str] = None) -> Stage:
        from skyspot.trainer.handover import HANDOVER_ENV

        now = self.clock()
        task = relaunch.relaunch_plan(
            self._task_for(mode), self.losses, now=now, burst_s=self.burst_seconds, restart_s=self.restart_seconds
        ).task
        if handover is not None:
            task = {**task, "envs": {**(task.get("envs") or {}), HANDOVER_ENV: handover}}
        secrets = sky_executor.secrets_for(task, self.plan.get("recipe") or self.run, self.environ)
        job_id = sky_executor.submit(task, name=self.run, detach=True, secrets=secrets)
        if not isinstance(job_id, int):
            raise SkyspotError(f"SkyPilot returned no job id for the {mode} stage of '{self.run}'")
        now = self.clock()
        return Stage(job_id, mode, now, now, handover=handover)

    def _cancel(self, stage: Stage) -> bool:
        """Cancel `stage` unless it ended, and wait up to CANCEL_WAIT_SECONDS for SkyPilot to report it ended
        (a job SkyPilot no longer knows has ended too); True once it has."""
        waited_until = self.clock() + CANCEL_WAIT_SECONDS
        cancelled = False
        while True:
            record = sky_executor.queue([stage.job_id]).get(stage.job_id)
            if record is None or has_ended(str(record.get("status") or "")):
                return True
            if not cancelled:
                sky_executor.cancel(stage.job_id)
                cancelled = True
            if self.clock() >= waited_until:
                break
            self.sleep(min(10.0, self.period))
        self.say(f"stage {stage.job_id} did not end within {CANCEL_WAIT_SECONDS:.0f}s of its cancel; asking again")
        return False

    def sleep(self, seconds: float) -> None:
        if self._sleep is not None:
            self._sleep(seconds)
        else:
            self.stop_requested.wait(seconds)

    def loop(self) -> int:
        while not self.stop_requested.is_set():
            try:
                code = self.step()
            except SkyspotError as error:  # SkyPilot or the store out of reach for a while: try again
                self.say(f"deadline: no decision this round: {error}")
                code = None
            if code is not None:
                return code
            self.sleep(self.pause())
        return self.stop()

    def stop(self) -> int:
        """Cancelled: cancel the stage too, so nothing keeps billing."""
        self._withdraw("the controller was cancelled")
        for stage in (self.retiring, self.stage):
            if stage is None:
                continue
            try:
                sky_executor.cancel(stage.job_id)
            except SkyspotError as error:
                self.say(f"could not cancel stage {stage.job_id}: {error}")
        self._emit(mode=dl.IDLE, reason="cancelled", why="the controller was cancelled")
        return 130


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m skyspot.executors.sky.deadline PLAN.json", file=sys.stderr)
        return EXIT_USAGE
    with open(argv[0], encoding="utf-8") as handle:
        plan = json.load(handle)
    controller = CloudController(plan)

    def request_stop(signum, frame):
        controller.stop_requested.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return controller.loop()


if __name__ == "__main__":
    sys.exit(main())
