"""SkyPilot's Python SDK, as the SkyPilot executor uses it: submit the rendered task as a managed job, read
its queue (and the `cluster_resources` string it reports), tail its logs, cancel it. The executor itself,
the executors' surface on top of these (skyspot/executors/__init__.py), is executors/sky/executor.py.

SkyPilot is imported here only, when a command needs it (it takes seconds to import
and starts a local API server on first use).
"""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, Optional

from skyspot.errors import NoCloudError, SkyspotError, UsageError
from skyspot.ledger import skyspot_home
from skyspot.wheelhouse import KEY_ENV as WHEELHOUSE_KEY, run_key
from skyspot.statuses import RunStatus

SKY_CHECK_HINT = "run `sky check` and set up credentials for one of them (docs.skypilot.co, 'Cloud account setup')"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# Whether this process started SkyPilot's local API server (enabled_clouds), so a refused launch can stop it again.
_started_api_server = False


def enabled_clouds() -> list[str]:
    """Clouds SkyPilot can launch on here, lower-case (asks the API server, starting it if needed).

    Starting the server takes half a minute and leaves several processes running, so it is said
    first, in one plain line; SkyPilot's own coloured start-up lines are kept out of our output."""
    global _started_api_server
    import sky
    from sky import sky_logging
    from sky.client import sdk

    starting = not api_server_healthy()
    if starting:
        print(
            "starting SkyPilot's local API server to ask which clouds are enabled (about 30 s, once; "
            "`sky api stop` stops it)",
            file=sys.stderr,
            flush=True,
        )
    try:
        with sky_logging.silent(starting):
            clouds = [str(c).lower() for c in sky.get(sdk.enabled_clouds())]
    except Exception as error:  # the API server could not be started or reached
        raise SkyspotError(f"cannot reach the SkyPilot API server: {_one_line(error)}; try `sky api start`") from None
    _started_api_server = _started_api_server or starting
    return clouds


def stop_api_server_we_started() -> bool:
    """Stop SkyPilot's API server if enabled_clouds started it in this process; True if it did."""
    global _started_api_server
    if not _started_api_server:
        return False
    from sky import sky_logging
    from sky.client import sdk

    try:
        with sky_logging.silent():
            sdk.api_stop()
    except Exception:
        return False
    _started_api_server = False
    return True


_SECRET_REASONS = {
    "HF_TOKEN": "the model is gated",
    "AZURE_STORAGE_KEY": "the az:// store's account key, for the nodes to write checkpoints",
    "WANDB_API_KEY": "metrics.backends has wandb (or drop wandb from it)",
}
# Declared by the task, sent only when set here: an MLflow server without authentication takes no token.
OPTIONAL_SECRETS = ("MLFLOW_TRACKING_TOKEN",)


def secrets_for(task: dict[str, Any], recipe_name: str, environ=os.environ) -> dict[str, str]:
    """Secret values the task declares, taken from the environment (never written to any file); the
    wheelhouse key is the run's own, from $SKYSPOT_HOME/keys/<run> (made there at the first launch),
    unless the environment has it (a deadline's controller, which got it as its own secret)."""
    declared = task.get("secrets") or {}
    values = {}
    for name in declared:
        value = environ.get(name)
        if name == WHEELHOUSE_KEY and not value:  # not the user's: the run's own key, kept on this machine
            value = run_key(skyspot_home(), (task.get("envs") or {}).get("SKYSPOT_RUN_NAME") or task.get("name"))
        if not value and name in OPTIONAL_SECRETS:
            continue
        if not value:
            why = _SECRET_REASONS.get(name, "the task declares it")
            raise UsageError(
                f"recipe '{recipe_name}' needs the secret {name} ({why}): export {name}=... and launch again"
            )
        values[name] = value
    return values


def to_sky_task(task: dict[str, Any], secrets: Optional[dict[str, str]] = None):
    """The sky.Task for a rendered task, secret values filled in memory.

    Secrets go in as `secrets_overrides`, exactly as SkyPilot's own CLI passes `--secret`:
    that replaces the task's `HF_TOKEN: null` declaration with the value. `update_secrets`
    after construction would leave the null behind as a *managed secret reference*, which
    the jobs controller cannot resolve (no managed secrets provider), so the job would
    retry forever and never start a VM.
    """
    import sky

    overrides = sorted(secrets.items()) if secrets else None
    # SkyPilot consumes the dict it is given.
    task = copy.deepcopy(task)
    for name in OPTIONAL_SECRETS:  # a null left behind would be a managed secret reference (above)
        if name in (task.get("secrets") or {}) and not (secrets or {}).get(name):
            del task["secrets"][name]
    if "secrets" in task and not task["secrets"]:
        del task["secrets"]
    return sky.Task.from_yaml_config(task, secrets_overrides=overrides)


def check_launchable(
    task: dict[str, Any], *, recipe_name: str, clouds: list[str], store: Optional[str], environ=os.environ
) -> dict[str, str]:
    """Everything that can be refused before a run is recorded; returns the secrets to send."""
    if not store:
        raise UsageError(
            "a cloud run needs a store for its checkpoints: pass --store s3://bucket/prefix "
            "(or gs://…, az://…) or set storage.store in the recipe"
        )
    secrets = secrets_for(task, recipe_name, environ)
    wanted = set(clouds)
    usable = [c for c in enabled_clouds() if c in wanted]
    if not usable:
        stopped = stop_api_server_we_started()  # nothing left running for a launch that was refused
        raise NoCloudError(
            f"SkyPilot has no enabled cloud among {', '.join(sorted(wanted))}: {SKY_CHECK_HINT}"
            + (" (the SkyPilot API server started for this check is stopped again)" if stopped else "")
        )
    return secrets


def submit(task: dict[str, Any], *, name: str, detach: bool, secrets: dict[str, str]) -> Optional[int]:
    """Launch the managed job named `name`; returns its job id. Raises SkyspotError with one line on failure."""
    import sky

    sky_task = to_sky_task(task, secrets)
    try:
        request_id = sky.jobs.launch(sky_task, name=name)
        result = sky.get(request_id) if detach else sky.stream_and_get(request_id)
    except Exception as error:
        raise SkyspotError(f"SkyPilot could not launch '{name}': {_one_line(error)}") from None
    job_ids = result[0] if isinstance(result, tuple) else result
    return job_ids[0] if isinstance(job_ids, list) and job_ids else job_ids


# Fields `status` and `cost-report` read from SkyPilot's managed-job queue (queue_v2 `fields`).
QUEUE_FIELDS = [
    "job_id",
    "job_name",
    "status",
    "recovery_count",
    "job_duration",
    "submitted_at",
    "end_at",
    "cloud",
    "region",
    "zone",
    "cluster_resources",
    "resources",
]


def api_server_healthy() -> bool:
    """Whether SkyPilot's API server answers, without starting one (status must stay quick and quiet)."""
    from sky.server import common as server_common

    try:
        return server_common.get_api_server_status().status == server_common.ApiServerStatus.HEALTHY
    except Exception:
        return False


def queue(job_ids: list[int]) -> dict[int, dict[str, Any]]:
    """SkyPilot's records for these managed jobs, keyed by job id. Raises SkyspotError when unreachable."""
    if not api_server_healthy():
        raise SkyspotError("the SkyPilot API server is not running")
    import sky

    try:
        result = sky.get(sky.jobs.queue_v2(refresh=False, job_ids=list(job_ids), fields=QUEUE_FIELDS))
    except Exception as error:
        raise SkyspotError(f"SkyPilot's job queue could not be read: {_one_line(error)}") from None
    records = result[0] if isinstance(result, tuple) else result
    out: dict[int, dict[str, Any]] = {}
    for record in records or []:
        data = record if isinstance(record, dict) else getattr(record, "model_dump", lambda: vars(record))()
        status = data.get("status")
        known = RunStatus.from_sky(status)  # the one reading of SkyPilot's statuses: a newer FAILED_* is FAILED
        data["status"] = known.value if known is not None else getattr(status, "value", status)
        out[int(data["job_id"])] = data
    return out


def cancel(job_id: int) -> None:
    import sky

    try:
        sky.get(sky.jobs.cancel(job_ids=[job_id]))
    except Exception as error:
        raise SkyspotError(f"SkyPilot could not cancel managed job {job_id}: {_one_line(error)}") from None


def tail_logs(job_id: int, follow: bool) -> int:
    import sky

    try:
        code = sky.jobs.tail_logs(job_id=job_id, follow=follow)
    except Exception as error:
        raise SkyspotError(f"SkyPilot could not stream the logs of managed job {job_id}: {_one_line(error)}") from None
    return int(code or 0)


def placed(record: Mapping[str, Any]) -> dict[str, Any]:
    """A queue record with its placement parsed (`where`, as where_from_queue reads it): what the
    executors' surface hands on, so a reader of records (cost.py) never parses SkyPilot's strings."""
    return {**record, "where": where_from_queue(record)}


def where_from_queue(record: Any) -> dict[str, Any]:
    """cloud, region, zone, nodes, spot, accelerators and instance type from a queue_v2 record.

    `cluster_resources(_full)` reads like "2x[spot](gpus=H100:8, p5.48xlarge, ...)"
    (sky.utils.resources_utils.format_resource); the short form truncates long type names.
    """

    def get(key: str) -> Any:
        return record.get(key) if isinstance(record, Mapping) else getattr(record, key, None)

    where: dict[str, Any] = {}
    for key in ("cloud", "region", "zone"):
        if get(key):
            where[key] = str(get(key)).lower() if key == "cloud" else get(key)
    text = str(get("cluster_resources_full") or get("cluster_resources") or "")
    match = re.match(r"\s*(\d+)x\s*(\[spot\])?\((.*)\)", text)
    if match:
        where["num_nodes"] = int(match.group(1))
        where["spot"] = bool(match.group(2))
        for part in (p.strip() for p in match.group(3).split(",")):
            if part.startswith("gpus="):
                where["accelerators"] = part[len("gpus=") :]
            elif part and "=" not in part and part != "..." and "..." not in part:
                where.setdefault("instance_type", part)
    return where


def record_status(runs, records: dict[int, dict]) -> None:
    """Keep the ledger's status of managed-job runs as SkyPilot last reported it, so every command
    (status, cost-report, resume) sees one status, also when SkyPilot is not reachable later."""
    from skyspot.ledger import STATUSES, Ledger

    changed = [
        (run, records[run.job_id]["status"])
        for run in runs
        if run.job_id in records
        and records[run.job_id].get("status") in STATUSES
        and records[run.job_id]["status"] != run.status
    ]
    if not changed:
        return
    with Ledger() as ledger:
        try:
            for run, status in changed:
                end = records[run.job_id].get("end_at")
                ledger.set_status(
                    run.name, status, ended_at=float(end) if isinstance(end, (int, float)) and end > 0 else None
                )
                run.status = status
        except Exception:  # a read-only or busy ledger: the next command tries again
            pass
