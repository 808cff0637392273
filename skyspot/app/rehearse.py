"""`skyspot launch RECIPE --rehearse`: prove each of a recipe's first candidates for a few dollars before the real run.

    plan = plan_rehearsals(request)      # the targets and the question it costs (nothing started)
    records = run_rehearsals(plan)       # one short job per target, waited for, recorded in $SKYSPOT_HOME

The first time a recipe meets a cloud's image should not be the real run (4 x 8 GPUs provisioned, set up,
and possibly failed three times: issue 30). A rehearsal is one short job per distinct (cloud, image,
accelerators) among the recipe's spot candidates, on spot, on as few nodes as prove the fabric (two for a
multi-node recipe, one otherwise). Its recipe is the real one with the model swapped for the bundled tiny
model (recipes/tiny.yaml's model, data and train sections), `REHEARSAL_STEPS` steps, no interval
checkpoints, no evaluation, no dashboards; resources, image, setup and store stay the real run's, and it is
rendered by the very `prepare` a real launch uses (app/launch.py), so setup is exactly the real run's. On the
node it does what every start does (the `node` event, the fabric probe at the trainer's start), plus the
store round trip before the trainer (task/rehearsal.py, trainer/round_trip.py). It is submitted through the
launch's own executor: a SkyPilot managed job on a cloud, or on the local executor a fresh node per target
simulating the candidate's cloud (`FRESH_NODE_LOCAL`).

Each outcome (works, or what failed in one line; minutes; cost as cost-report prices the run) is recorded
(app/rehearsal_record.py); the real launch afterwards leaves out the candidates whose rehearsal failed,
unless `--force` (app/launch.py prepare).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from pydantic import BaseModel

from skyspot.app import rehearsal_record
from skyspot.app.launch import LaunchRequest, Prepared, prepare
from skyspot.app.rehearsal_record import Key, Record
from skyspot.errors import SkyspotError
from skyspot.executors import Executor
from skyspot.ledger import Ledger, Run, new_run_name
from skyspot.planning.candidates import Candidate, region_cloud
from skyspot.recipe import Recipe, load_recipe, value_text
from skyspot.task.rehearsal import rehearsal_task
from skyspot.task.render import to_yaml

TINY = "tiny"
"""The bundled tiny model whose model, data and train sections a rehearsal trains (no download)."""
REHEARSAL_STEPS = 5
FRESH_NODE_LOCAL = True
"""On the local executor each rehearsal runs on a fresh node (executors/local/fresh_node.py), as a cloud VM
starts from its image; a test sets it False to rehearse in this environment, which is faster."""
WAIT_SECONDS = 3600.0
"""The longest a rehearsal is waited for (provisioning, setup, a few steps) before it counts as failed."""
POLL_SECONDS = 1.0
CAUSE_CHARS = 300
CLOUD_POLL_SECONDS = 15.0
"""How often SkyPilot's job queue is asked about a cloud rehearsal (a local one reads the ledger every POLL_SECONDS)."""
# Local fault injection belongs to a launch's own timeline, never to a rehearsal's.
_NOT_REHEARSED = (
    "preempt_every",
    "preempt_at_steps",
    "crash_at_steps",
    "hang_at_steps",
    "cut_link_at_steps",
    "netns",
    "spot_trace",
    "fallback_after",
    "spot_nodes",
)


@dataclass(frozen=True)
class Target:
    """One rehearsal: a key and the cheapest spot candidate that has it."""

    key: Key
    candidate: Candidate
    nodes: int


@dataclass
class RehearsalPlan:
    """What `--rehearse` will run, before anything starts: the CLI shows it and asks `question`."""

    request: LaunchRequest
    recipe: Recipe
    prepared: Prepared
    """The real launch as planned now (its dry run), from which the targets come."""
    targets: list[Target]
    question: Optional[str]
    """The confirmation the rehearsals cost (cloud money), or None (local)."""

    @property
    def executor(self) -> Executor:
        return self.prepared.executor


def targets(prepared: Prepared) -> list[Target]:
    """One target per distinct (cloud, image, accelerators) among the spot candidates (the first ones; all of
    them when the recipe has no spot), each the cheapest candidate with that key, in the plan's order."""
    built = prepared.built
    pairs = list(zip(built.candidates, built.task["resources"]["ordered"]))
    first = [pair for pair in pairs if pair[0].spot] or pairs
    nodes = 2 if built.recipe.resources.num_nodes > 1 else 1
    found: dict[Key, Target] = {}
    for candidate, entry in first:
        key = rehearsal_record.key_of(candidate, entry)
        found.setdefault(key, Target(key, candidate, nodes))
    return list(found.values())


def plan_rehearsals(request: LaunchRequest) -> RehearsalPlan:
    """Plan the rehearsals of `request`'s recipe: its dry run (every check a launch makes, nothing started),
    every candidate kept (a rehearsal rehearses the failed ones again), and the targets."""
    planned = prepare(replace(request, dry_run=True, force=True, name=None))
    found = targets(planned)
    question = None
    if not planned.executor.runs_here:
        question = (
            f"Rehearse '{planned.recipe.name}' on {len(found)} spot candidate(s) "
            f"({', '.join(t.key.text() for t in found)}), then launch it?"
        )
    return RehearsalPlan(request=request, recipe=planned.recipe, prepared=planned, targets=found, question=question)


def rehearsal_overrides(recipe: Recipe, target: Target) -> list[str]:
    """The real recipe turned into its rehearsal: the tiny model, a few steps, only this target's resources."""
    tiny = load_recipe(TINY)
    cloud = target.candidate.cloud
    regions = [r for r in recipe.resources.regions if region_cloud(r) == cloud]
    accelerators = [target.candidate.accelerators] if target.candidate.accelerators else []

    def section(model: BaseModel) -> str:
        return value_text(model.model_dump(exclude_none=True))

    return [
        f"model={section(tiny.model)}",
        f"data={section(tiny.data)}",
        f"train={section(tiny.train)}",
        f"train.steps={REHEARSAL_STEPS}",
        "train.warmup_steps=0",
        "train.log_every=1",
        "checkpoint.every_steps=null",
        "checkpoint.every_seconds=null",
        "eval={}",
        "export.merge=false",
        "metrics.backends=[]",
        f"resources.clouds={value_text([cloud])}",
        f"resources.accelerators={value_text(accelerators)}",
        f"resources.regions={value_text(regions)}",
        f"resources.num_nodes={target.nodes}",
        "resources.min_nodes=null",
        "resources.spot=true",
        "resources.on_demand_fallback=false",
        "resources.deadline=null",
    ]


def _request_for(plan: RehearsalPlan, target: Target) -> LaunchRequest:
    request = plan.request
    flags = {
        **request.flags,
        "resources.clouds": None,
        "resources.on_demand_fallback": None,
        "resources.deadline": None,
    }  # the target's own resources, set by the overrides
    executor_flags = {k: (None if k in _NOT_REHEARSED else v) for k, v in request.executor_flags.items()}
    if plan.executor.runs_here:
        executor_flags.update(simulate=target.candidate.cloud, fresh_node=FRESH_NODE_LOCAL or None)
    return replace(
        request,
        overrides=[*request.overrides, *rehearsal_overrides(plan.recipe, target)],
        flags=flags,
        executor_flags=executor_flags,
        dry_run=False,
        confirmed=True,
        force=True,
        name=new_run_name(f"{plan.recipe.name}-rehearse-{target.candidate.cloud}"),
    )


def run_rehearsals(plan: RehearsalPlan) -> list[Record]:
    """Run every target's rehearsal, one after another, wait for each, and record what they found."""
    records = [rehearse(plan, target) for target in plan.targets]
    rehearsal_record.write(records)
    return records


def rehearse(plan: RehearsalPlan, target: Target) -> Record:
    """One rehearsal, submitted through the launch's executor and waited for; a refusal before it starts (the
    executor's, the preflight's) is its outcome too."""
    started = time.time()
    request = _request_for(plan, target)
    try:
        prepared = prepare(request)
        built = prepared.built
        built = replace(built, task=rehearsal_task(built.task, built.recipe.storage.store))
        built = replace(built, yaml=to_yaml(built.task, built.recipe))
        prepared.executor.submit(built, detach=True, deadline=None)
    except SkyspotError as error:
        return _record(target, request.name or "", ok=False, line=f"not started: {error}", started=started, cost=0.0)
    run = _wait(request.name or "", prepared.executor)
    ok = run.status == "SUCCEEDED"
    line = "works" if ok else _what_failed(run)
    return _record(target, run.name, ok=ok, line=line, started=run.created_at, cost=_cost(run), ended=run.ended_at)


def _record(
    target: Target,
    run: str,
    *,
    ok: bool,
    line: str,
    started: float,
    cost: Optional[float],
    ended: Optional[float] = None,
) -> Record:
    ended = time.time() if ended is None else ended
    return Record(
        cloud=target.key.cloud,
        image=target.key.image,
        accelerators=target.key.accelerators,
        at=ended,
        ok=ok,
        line=" ".join(line.split()),
        minutes=round(max(0.0, ended - started) / 60, 2),
        cost_usd=cost,
        run=run,
    )


def _wait(name: str, executor: Executor) -> Run:
    """The rehearsal's ledger row once it ended (the executor's records refreshed into it), or, past
    WAIT_SECONDS, as it stands then."""
    give_up = time.monotonic() + WAIT_SECONDS
    while True:
        with Ledger() as ledger:
            run = ledger.get(name)
        if not run.terminal:
            executor.refresh([run])
            with Ledger() as ledger:
                run = ledger.get(name)
        if run.terminal or time.monotonic() > give_up:
            return run
        time.sleep(POLL_SECONDS if executor.runs_here else CLOUD_POLL_SECONDS)


def _what_failed(run: Run) -> str:
    """The one line that says why: the rehearsal's own (the store round trip), the node's setup record, the
    executor's cause, else the status."""
    if not run.terminal:
        return f"still {run.status} after {WAIT_SECONDS / 60:.0f} minutes; `skyspot cancel {run.name}` stops it"
    line = _rehearsal_line(run)
    if line is None and run.status == "FAILED_SETUP":
        from skyspot.app.status import setup_failure

        try:
            line = setup_failure(run)
        except SkyspotError:
            line = None
    cause = run.info.get("cause")
    line = line or (str(cause) if cause else None)
    code = f", exit {run.exit_code}" if run.exit_code not in (None, 0) else ""
    return f"{run.status}{code}: {line}" if line else f"{run.status}{code}; `skyspot logs {run.name}` has its output"


def _rehearsal_line(run: Run) -> Optional[str]:
    """The store round trip's failure, as the node printed it to the run's log (local runs)."""
    log = run.info.get("log")
    if not isinstance(log, str):
        return None
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if "skyspot rehearsal:" in line and "failed" in line]
    if lines:
        return lines[-1].split("skyspot rehearsal:", 1)[1].strip()
    if run.info.get("cause"):
        return None
    # No cause recorded: the node's own last line (the executor's lines start with its bracketed name).
    nodes = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("[skyspot local]")]
    return nodes[-1][:CAUSE_CHARS] if nodes else None


def _cost(run: Run) -> Optional[float]:
    """What the rehearsal cost, as cost-report prices a run (app/report.py); None when it cannot say."""
    from skyspot.app.report import run_report

    try:
        return run_report(run).cost.cost_usd
    except SkyspotError:
        return None
