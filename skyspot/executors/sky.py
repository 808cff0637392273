"""The SkyPilot executor: submit the rendered task as a managed job through SkyPilot's Python SDK.

SkyPilot is imported here only, when a command needs it (it takes seconds to import
and starts a local API server on first use).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Optional

from skyspot.errors import NoCloudError, SkyspotError, UsageError
from skyspot.launch import Built

SKY_CHECK_HINT = "run `sky check` and set up credentials for one of them (docs.skypilot.co, 'Cloud account setup')"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def enabled_clouds() -> list[str]:
    """Clouds SkyPilot can launch on here, lower-case (asks the API server, starting it if needed)."""
    import sky
    from sky.client import sdk

    try:
        return [str(c).lower() for c in sky.get(sdk.enabled_clouds())]
    except Exception as error:  # the API server could not be started or reached
        raise SkyspotError(f"cannot reach the SkyPilot API server: {_one_line(error)}; try `sky api start`") from None


def secrets_for(built: Built, environ=os.environ) -> dict[str, str]:
    """Secret values the task declares, taken from the environment (never written to any file)."""
    declared = built.task.get("secrets") or {}
    values = {}
    for name in declared:
        value = environ.get(name)
        if not value:
            raise UsageError(f"recipe '{built.recipe.name}' needs the secret {name} "
                             f"(the model is gated): export {name}=... and launch again")
        values[name] = value
    return values


def to_sky_task(built: Built, secrets: Optional[dict[str, str]] = None):
    import sky

    task = sky.Task.from_yaml_config(copy.deepcopy(built.task))  # SkyPilot consumes the dict it is given
    if secrets:
        task.update_secrets(secrets)
    return task


def submit(built: Built, *, name: str, detach: bool) -> dict[str, Any]:
    """Launch the managed job; returns {'job_id': int | None}. Raises SkyspotError with one line on failure."""
    wanted = set(built.recipe.resources.clouds)
    if not built.recipe.storage.store:
        raise UsageError(f"a cloud run needs a store for its checkpoints: pass --store s3://bucket/prefix "
                         f"(or gs://…, az://…) or set storage.store in the recipe")
    secrets = secrets_for(built)
    usable = [c for c in enabled_clouds() if c in wanted]
    if not usable:
        raise NoCloudError(f"SkyPilot has no enabled cloud among {', '.join(sorted(wanted))}: {SKY_CHECK_HINT}")
    import sky

    task = to_sky_task(built, secrets)
    try:
        request_id = sky.jobs.launch(task, name=name)
        result = sky.get(request_id) if detach else sky.stream_and_get(request_id)
    except Exception as error:
        raise SkyspotError(f"SkyPilot could not launch '{name}': {_one_line(error)}") from None
    job_ids = result[0] if isinstance(result, tuple) else result
    job_id = job_ids[0] if isinstance(job_ids, list) and job_ids else job_ids
    return {"job_id": job_id}
