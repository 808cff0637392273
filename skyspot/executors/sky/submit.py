"""Submitting to SkyPilot: a built run recorded and launched as a managed job, and a stopped one resumed.

    submit_cloud(built, detach=False, deadline=None)   # the job id; the ledger row written first
    resume_cloud(run, detach=False)                    # the same run name, its recorded task

What can be refused is refused before the run is recorded (executors/sky/sdk.py check_launchable); a
submission that fails leaves a FAILED row rather than no trace. With a deadline the job submitted
is the deadline's controller (executors/sky/deadline.py, docs/deadline.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from skyspot.ledger import Ledger
from skyspot.task.package import PACKAGE_MOUNT, Package
from skyspot.task.render import RenderedTask


def submit_cloud(
    built: RenderedTask,
    *,
    detach: bool,
    environ: Optional[Mapping[str, str]] = None,
    deadline: Optional[dict[str, Any]] = None,
) -> Optional[int]:
    """Submit a built task as a SkyPilot managed job named `built.run_name`; returns the job id.

    What can be refused (no store, a missing secret, no enabled cloud) was refused before
    (SkyExecutor.check, executors/sky/executor.py); the run is recorded first, so a submission that
    fails leaves a FAILED row rather than no trace. The ledger keeps the rendered task (never a secret value) for `skyspot resume`. With a
    `deadline` (plan_deadline) the job submitted is the deadline's controller, which runs the
    task itself on spot or on-demand (executors/sky/deadline.py, docs/deadline.md)."""
    from skyspot.executors.sky import sdk as sky_executor
    from skyspot.ledger import record_launch

    recipe = built.recipe
    # Asked again (launch.launch asked executor.check first): secret values are never kept anywhere.
    secrets = sky_executor.secrets_for(built.task, recipe.name, os.environ if environ is None else environ)
    supervised = bool(deadline) or recipe.resources.supervise
    if supervised:
        from skyspot.executors.sky.deadline import check_api_server

        check_api_server()
    burst = recipe.resources.burst_minutes * 60.0
    record_launch(
        built.run_name,
        built,
        "sky",
        info={
            "task": built.task,
            **({"deadline": deadline} if deadline else {}),
            **({"supervised": {"burst_seconds": burst}} if supervised else {}),
        },
    )
    task = built.task
    if supervised:
        task = _controller(
            built.run_name,
            built.task,
            recipe=recipe.name,
            store=recipe.storage.store,
            total_steps=recipe.train.steps,
            deadline=deadline,
            burst_seconds=burst,
            package=built.package,
        )
    return _submit_recorded(built.run_name, task, detach=detach, secrets=secrets)


def _controller(
    name: str,
    task: dict[str, Any],
    *,
    recipe: str,
    store: str,
    total_steps: int,
    deadline: Optional[dict[str, Any]],
    burst_seconds: float,
    package: Optional[Package],
) -> dict[str, Any]:
    """The managed-job task of the run's controller (a deadline's, or a supervised run's), its plan written
    where the task mounts it from."""
    from skyspot.executors.sky import deadline as sky_deadline
    from skyspot.ledger import skyspot_home

    plan = sky_deadline.plan_for(
        task,
        run=name,
        store=store,
        deadline=deadline,
        total_steps=total_steps,
        recipe=recipe,
        burst_seconds=burst_seconds,
    )
    plan["plan_dir"] = sky_deadline.write_plan(skyspot_home(), plan)
    ordered = (task.get("resources") or {}).get("ordered") or (task.get("resources") or {}).get("any_of") or []
    clouds = list(dict.fromkeys(str(c["cloud"]) for c in ordered if c.get("cloud"))) or ["aws", "gcp", "azure"]
    return sky_deadline.controller_task(task, plan, clouds=clouds, package=package)


def _submit_recorded(name: str, task: dict[str, Any], *, detach: bool, secrets: dict[str, str]) -> Optional[int]:
    from skyspot.executors.sky import sdk as sky_executor

    try:
        job_id = sky_executor.submit(task, name=name, detach=detach, secrets=secrets)
    except BaseException:
        with Ledger() as ledger:
            ledger.set_failed(name)
        raise
    if job_id is not None:
        with Ledger() as ledger:
            ledger.set_job(name, job_id)
    return job_id


def resume_cloud(run, *, detach: bool, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Submit a cancelled or failed managed-job run again under its own name; returns the new job id.

    The node gets the same SKYSPOT_RUN_NAME, so it resumes from the newest durable checkpoint
    under the same store prefix. The task is the one recorded at launch; the skyspot wheel is
    rebuilt from the skyspot running now (the same build when nothing changed)."""
    import copy

    from skyspot.task import package as packaging
    from skyspot.errors import SkyspotError, UsageError
    from skyspot.executors.sky import sdk as sky_executor
    from skyspot.statuses import has_ended

    if run.job_id is not None and not run.terminal:
        status = (sky_executor.queue([run.job_id]).get(run.job_id) or {}).get("status")
        if not has_ended(status):
            raise UsageError(
                f"run '{run.name}' is {status or 'unknown to SkyPilot'}: SkyPilot recovers a live "
                f"managed job itself; `skyspot cancel {run.name}` first to restart it"
            )
    task = run.info.get("task")
    if not isinstance(task, dict):
        raise SkyspotError(
            f"run '{run.name}' was recorded without its task (launched by an older skyspot), "
            "so it cannot be resubmitted; launch the recipe again"
        )
    task = copy.deepcopy(task)
    mounts = task.setdefault("file_mounts", {})
    mounts[PACKAGE_MOUNT] = str(packaging.build().folder)
    for target, source in mounts.items():
        if isinstance(source, str) and "://" not in source and not Path(source).exists():
            raise UsageError(
                f"run '{run.name}' mounts {source} at {target}, and that file is gone; put it back to resume"
            )
    secrets = sky_executor.secrets_for(task, run.recipe, os.environ if environ is None else environ)
    deadline = run.info.get("deadline")
    supervised = run.info.get("supervised")
    if isinstance(deadline, dict) or isinstance(supervised, dict):
        from skyspot.executors.sky.deadline import check_api_server

        check_api_server()
    with Ledger() as ledger:
        ledger.set_resumed(run.name, previous_job_id=run.job_id or None, task=task)
    if isinstance(deadline, dict) or isinstance(supervised, dict):  # as at launch: its controller starts again
        task = _controller(
            run.name,
            task,
            recipe=run.recipe,
            store=run.store,
            total_steps=run.total_steps,
            deadline=deadline if isinstance(deadline, dict) else None,
            burst_seconds=float((supervised or {}).get("burst_seconds") or 0.0)
            if isinstance(supervised, dict)
            else 0.0,
            package=packaging.build(),
        )
    return _submit_recorded(run.name, task, detach=detach, secrets=secrets)
