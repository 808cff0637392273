"""Launch: recipe + overrides + flags -> a rendered task, ready for an executor.

One function (`build`) so that `render`, `launch --dry-run`, `launch` and the local
executor all see the same recipe, the same candidates and the same YAML.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from pydantic import BaseModel

from skyspot.package import PACKAGE_MOUNT, Package
from skyspot.plan import Candidate, candidates
from skyspot.recipe import REGISTRY, Recipe, load_recipe, override_texts, parse_overrides, value_text
from skyspot.task import RECIPE_MOUNT, render, to_yaml

# `resources` says where to run: the plan and SkyPilot have decided that before a node exists,
# and the trainer never reads it. Every other value set on top of the recipe file travels.
LAUNCH_ONLY_SECTIONS = ("resources",)


@dataclass
class Built:
    recipe: Recipe
    recipe_arg: str
    task: dict[str, Any]
    yaml: str
    candidates: list[Candidate]
    trainer_overrides: list[str] = field(default_factory=list)
    """Values set on top of the recipe file (environment, command line, flags), for the node."""
    run_name: Optional[str] = None
    """The one name of the run: managed job, ledger row, the node's run id, the store prefix."""
    package: Optional[Package] = None
    """The skyspot wheel the nodes install (None: the task shows a placeholder)."""


def _trainer_overrides(recipe: Recipe, overrides: Sequence[str], environ: Mapping[str, str],
                       flags: Optional[Mapping[str, Any]]) -> list[str]:
    """What the node's trainer gets on top of the recipe: every key the environment, the command
    line and the flags set here, once each, as `key=value` with the value this launch resolved
    (task.py sends them). Resolved, not replayed: the node applies its overrides in the order it
    gets them, and the launch applied them by precedence (flags > command line, in its order >
    environment), so a section override beside a key inside it (`'storage={store: A}' --store B`)
    would resolve to another value there. One value per key, at the outermost key where both a
    section and a key in it were set, cannot."""
    texts = override_texts(overrides, environ=environ, flags=flags)
    keys = [key for key in texts if key.split(".")[0] not in LAUNCH_ONLY_SECTIONS]
    outermost = [key for key in keys
                 if not any(key.startswith(other + ".") for other in keys if other != key)]
    return [_resolved_text(recipe, key, texts[key]) for key in outermost]


def _resolved_text(recipe: Recipe, key: str, typed: str) -> str:
    """`key=value` with the recipe's validated value at `key`: the user's own text where it reads
    back to that value (the node then sees what the user typed), else the value written anew (a
    section beside a key in it, a relative path made absolute, `S3://` spelled `s3://`)."""
    node: Any = recipe
    for part in key.split("."):
        if isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return typed
    value = node.model_dump() if isinstance(node, BaseModel) else node
    if not isinstance(node, BaseModel) and parse_overrides([typed])[0][1] == value:
        return typed
    return f"{key}={value_text(value)}"


def build(recipe_arg: str, overrides: Sequence[str] = (), *, flags: Optional[Mapping[str, Any]] = None,
          run_name: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
          local: bool = False, package: Optional[Package] = None) -> Built:
    """Load and render. A registry name travels to the node as is; a recipe file is mounted
    on cloud nodes (RECIPE_MOUNT) or, for the local executor (`local`), read where it is.
    `package` is the skyspot wheel the nodes install (package.build())."""
    environ = os.environ if environ is None else environ
    recipe = load_recipe(recipe_arg, overrides, environ=environ, flags=flags)
    trainer_overrides = _trainer_overrides(recipe, overrides, environ, flags)
    planned = candidates(recipe)
    if recipe_arg in REGISTRY:
        node_arg, recipe_file = recipe_arg, None
    elif local:
        node_arg, recipe_file = str(Path(recipe_arg).resolve()), None
    else:
        node_arg, recipe_file = RECIPE_MOUNT, str(Path(recipe_arg).resolve())
    task = render(recipe, planned, recipe_arg=node_arg, recipe_file=recipe_file, overrides=trainer_overrides,
                  run_name=run_name, package_dir=str(package.folder) if package else None, local=local)
    return Built(recipe=recipe, recipe_arg=recipe_arg, task=task, yaml=to_yaml(task, recipe),
                 candidates=planned, trainer_overrides=trainer_overrides, run_name=run_name,
                 package=package)


def check_store(recipe: Recipe, *, local: bool) -> Optional[str]:
    """The run's store, checked against where the run runs; what the ledger records, the task
    mounts and the trainer resolves (they all read `recipe.storage.store`, which load_recipe
    decided by its one precedence rule and storage/uri.py spelled once, a local path absolute).

    A cloud run refuses a store on this machine: its checkpoints would live on a VM that a
    preemption takes away, and no other node could resume from them."""
    from skyspot.errors import UsageError
    from skyspot.storage import parse_store_uri

    store = recipe.storage.store
    if store and not local and parse_store_uri(store).is_local:
        raise UsageError(f"storage.store {store} is a directory on this machine; a cloud run's checkpoints must "
                         "outlive its VMs: give a bucket (--store s3://BUCKET/PREFIX, gs://..., az://...), or run "
                         "with --local")
    return store


def plan_deadline(recipe: Recipe, *, local: bool, provision_seconds: float = 0.0,
                  now: Optional[float] = None) -> Optional[dict[str, Any]]:
    """The launch's deadline (resources.deadline, or --deadline), or None: when it falls (a duration
    counts from now), the policy and the step-time hint. A deadline that even all on-demand cannot
    make is refused here, with the arithmetic, before anything is recorded or paid for."""
    import time

    from skyspot import deadline as dl
    from skyspot.errors import UsageError

    text = recipe.resources.deadline
    if not text:
        return None
    now = time.time() if now is None else now
    try:
        at = dl.parse_deadline(text, now)
    except dl.DeadlineError as error:
        raise UsageError(str(error)) from None
    if at - now > dl.MAX_AHEAD_SECONDS:
        raise UsageError(f"deadline {dl.when(at)} is more than {dl.MAX_AHEAD_SECONDS / 86400:.0f} days away: give "
                         "a nearer one, or launch without --deadline")
    from skyspot.step_prior import step_seconds_floor

    restart = provision_seconds + dl.LOCAL_START_PRIOR_SECONDS if local else dl.CLOUD_RESTART_PRIOR_SECONDS
    floor, floor_source = step_seconds_floor(recipe)
    check = dl.feasibility(now=now, deadline=at, steps=recipe.train.steps,
                           step_seconds_hint=recipe.resources.step_seconds_hint, restart_seconds=restart,
                           step_seconds_floor=floor, floor_source=floor_source)
    if not check.ok:
        raise UsageError(check.text)
    return {"at": at, "start": now, "given": text, "policy": recipe.resources.deadline_policy,
            "step_seconds_hint": recipe.resources.step_seconds_hint, "step_seconds_prior": floor or None,
            "check": check.text}


def submit_cloud(built: Built, *, detach: bool, environ: Optional[Mapping[str, str]] = None,
                 deadline: Optional[dict[str, Any]] = None) -> Optional[int]:
    """Submit a built task as a SkyPilot managed job named `built.run_name`; returns the job id.

    What can be refused (no store, a missing secret, no enabled cloud) is refused first; then
    the run is recorded, so a submission that fails leaves a FAILED row rather than no trace.
    The ledger keeps the rendered task (never a secret value) for `skyspot resume`. With a
    `deadline` (plan_deadline) the job submitted is the deadline's controller, which runs the
    task itself on spot or on-demand (executors/sky_deadline.py, docs/deadline.md)."""
    from skyspot.executors import sky as sky_executor
    from skyspot.runs import record_launch

    recipe = built.recipe
    check_store(recipe, local=False)
    secrets = sky_executor.check_launchable(built.task, recipe_name=recipe.name, clouds=list(recipe.resources.clouds),
                                            store=recipe.storage.store,
                                            environ=os.environ if environ is None else environ)
    from skyspot.preflight import preflight

    # The hub, the model and the data, asked from here before any node is paid for (preflight.py).
    preflight(recipe, local=False, environ=os.environ if environ is None else environ)
    if deadline:
        from skyspot.executors.sky_deadline import check_api_server

        check_api_server()
    record_launch(built.run_name, built, "sky", info={"task": built.task, **({"deadline": deadline} if deadline else {})})
    task = built.task
    if deadline:
        task = _deadline_controller(built.run_name, built.task, recipe=recipe.name, store=recipe.storage.store,
                                    total_steps=recipe.train.steps, deadline=deadline, package=built.package)
    return _submit_recorded(built.run_name, task, detach=detach, secrets=secrets)


def _deadline_controller(name: str, task: dict[str, Any], *, recipe: str, store: str, total_steps: int,
                         deadline: dict[str, Any], package: Optional[Package]) -> dict[str, Any]:
    """The managed-job task of a deadline's controller, its plan written where the task mounts it from."""
    from skyspot.executors import sky_deadline
    from skyspot.ledger import skyspot_home

    plan = sky_deadline.plan_for(task, run=name, store=store, deadline=deadline, total_steps=total_steps,
                                 recipe=recipe)
    plan["plan_dir"] = sky_deadline.write_plan(skyspot_home(), plan)
    ordered = (task.get("resources") or {}).get("ordered") or (task.get("resources") or {}).get("any_of") or []
    clouds = list(dict.fromkeys(str(c["cloud"]) for c in ordered if c.get("cloud"))) or ["aws", "gcp", "azure"]
    return sky_deadline.controller_task(task, plan, clouds=clouds, package=package)


def _submit_recorded(name: str, task: dict[str, Any], *, detach: bool, secrets: dict[str, str]) -> Optional[int]:
    from skyspot.executors import sky as sky_executor

    try:
        job_id = sky_executor.submit(task, name=name, detach=detach, secrets=secrets)
    except BaseException:
        _update(name, status="FAILED", exit_code=1)
        raise
    _update(name, job_id=job_id)
    return job_id


def _update(name: str, **fields: Any) -> None:
    from skyspot.ledger import Ledger

    with Ledger() as ledger:
        ledger.update(name, **fields)


def resume_cloud(run, *, detach: bool, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Submit a cancelled or failed managed-job run again under its own name; returns the new job id.

    The node gets the same SKYSPOT_RUN_NAME, so it resumes from the newest durable checkpoint
    under the same store prefix. The task is the one recorded at launch; the skyspot wheel is
    rebuilt from the skyspot running now (the same build when nothing changed)."""
    import copy

    from skyspot import package as packaging
    from skyspot.errors import SkyspotError, UsageError
    from skyspot.executors import sky as sky_executor
    from skyspot.ledger import TERMINAL

    if run.job_id is not None and not run.terminal:
        status = (sky_executor.queue([run.job_id]).get(run.job_id) or {}).get("status")
        if status not in TERMINAL:
            raise UsageError(f"run '{run.name}' is {status or 'unknown to SkyPilot'}: SkyPilot recovers a live "
                             f"managed job itself; `skyspot cancel {run.name}` first to restart it")
    task = run.info.get("task")
    if not isinstance(task, dict):
        raise SkyspotError(f"run '{run.name}' was recorded without its task (launched by an older skyspot), "
                           "so it cannot be resubmitted; launch the recipe again")
    task = copy.deepcopy(task)
    mounts = task.setdefault("file_mounts", {})
    mounts[PACKAGE_MOUNT] = str(packaging.build().folder)
    for target, source in mounts.items():
        if isinstance(source, str) and "://" not in source and not Path(source).exists():
            raise UsageError(f"run '{run.name}' mounts {source} at {target}, and that file is gone; "
                             "put it back to resume")
    secrets = sky_executor.secrets_for(task, run.recipe, os.environ if environ is None else environ)
    deadline = run.info.get("deadline")
    if isinstance(deadline, dict):
        from skyspot.executors.sky_deadline import check_api_server

        check_api_server()
    previous = [j for j in (run.info.get("previous_job_ids") or []) if isinstance(j, int)]
    _update(run.name, status="PENDING", ended_at=None, exit_code=None,
            info={**run.info, "task": task, "previous_job_ids": previous + [run.job_id] if run.job_id else previous})
    if isinstance(deadline, dict):  # the same deadline as at launch: its controller starts again
        task = _deadline_controller(run.name, task, recipe=run.recipe, store=run.store, total_steps=run.total_steps,
                                    deadline=deadline, package=packaging.build())
    return _submit_recorded(run.name, task, detach=detach, secrets=secrets)
