"""Launch: recipe + overrides + flags -> a rendered task, ready for an executor.

One function (`build`) so that `render`, `launch --dry-run`, `launch` and the local
executor all see the same recipe, the same candidates and the same YAML; one (`launch`) that
hands a built run to its executor, the same steps for every kind of run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from skyspot.package import Package
from skyspot.plan import candidates
from skyspot.recipe import REGISTRY, Recipe, load_recipe, override_texts
from skyspot.task import RECIPE_MOUNT, RenderedTask, render, to_yaml

# `resources` says where to run: the plan and SkyPilot have decided that before a node exists,
# and the trainer never reads it. Every other value set on top of the recipe file travels.
LAUNCH_ONLY_SECTIONS = ("resources",)


def _trainer_overrides(overrides: Sequence[str], environ: Mapping[str, str],
                       flags: Optional[Mapping[str, Any]]) -> list[str]:
    """What the node's trainer gets on top of the recipe: every value the environment, the command
    line and the flags set here, as `section.key=value` overrides (task.py sends them)."""
    texts = override_texts(overrides, environ=environ, flags=flags)
    return [text for key, text in texts.items() if key.split(".")[0] not in LAUNCH_ONLY_SECTIONS]


def build(recipe_arg: str, overrides: Sequence[str] = (), *, flags: Optional[Mapping[str, Any]] = None,
          run_name: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
          local: bool = False, package: Optional[Package] = None) -> RenderedTask:
    """Load and render. A registry name travels to the node as is; a recipe file is mounted
    on cloud nodes (RECIPE_MOUNT) or, for the local executor (`local`), read where it is.
    `package` is the skyspot wheel the nodes install (package.build())."""
    environ = os.environ if environ is None else environ
    recipe = load_recipe(recipe_arg, overrides, environ=environ, flags=flags)
    trainer_overrides = _trainer_overrides(overrides, environ, flags)
    planned = candidates(recipe)
    if recipe_arg in REGISTRY:
        node_arg, recipe_file = recipe_arg, None
    elif local:
        node_arg, recipe_file = str(Path(recipe_arg).resolve()), None
    else:
        node_arg, recipe_file = RECIPE_MOUNT, str(Path(recipe_arg).resolve())
    task = render(recipe, planned, recipe_arg=node_arg, recipe_file=recipe_file, overrides=trainer_overrides,
                  run_name=run_name, package_dir=str(package.folder) if package else None)
    return RenderedTask(recipe=recipe, recipe_arg=recipe_arg, task=task, yaml=to_yaml(task, recipe),
                 candidates=planned, trainer_overrides=trainer_overrides, run_name=run_name,
                 package=package)


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
    restart = provision_seconds + dl.LOCAL_START_PRIOR_SECONDS if local else dl.CLOUD_RESTART_PRIOR_SECONDS
    check = dl.feasibility(now=now, deadline=at, steps=recipe.train.steps,
                           step_seconds_hint=recipe.resources.step_seconds_hint, restart_seconds=restart)
    if not check.ok:
        raise UsageError(check.text)
    return {"at": at, "start": now, "given": text, "policy": recipe.resources.deadline_policy,
            "step_seconds_hint": recipe.resources.step_seconds_hint, "check": check.text}


def launch(built: RenderedTask, executor, *, detach: bool, deadline: Optional[dict[str, Any]] = None,
           environ: Optional[Mapping[str, str]] = None) -> int:
    """Start a built run on `executor` (executors.executor_for): what the executor refuses, then the
    preflight (the hub, the model and the data, asked from here before any node is paid for or the run
    starts: preflight.py), then the executor records and submits it. Returns the exit code to pass on."""
    from skyspot.preflight import preflight

    executor.check(built)
    preflight(built.recipe, local=executor.runs_here, environ=os.environ if environ is None else environ)
    return executor.submit(built, detach=detach, deadline=deadline)
