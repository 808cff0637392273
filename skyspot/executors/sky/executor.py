"""The SkyPilot executor: managed-job runs behind the executors' surface (skyspot/executors/__init__.py).

Its `EXECUTOR` answers for the runs SkyPilot keeps (status, logs, recovery); it drives the SDK
(executors/sky/sdk.py), the submission (executors/sky/submit.py) and the deadline's controller
(executors/sky/deadline.py), which import this module never, so the three stay a line, not a circle.
"""

from __future__ import annotations

from typing import Any, Mapping

from skyspot.console import err
from skyspot.errors import SkyspotError, UsageError
from skyspot.executors.sky import sdk  # by module: a test's monkeypatch of the SDK reaches here too


class SkyExecutor:
    """Managed-job runs behind the executors' surface: SkyPilot keeps their status, logs and recovery."""

    name = "sky"
    local_events = False
    runs_here = False
    simulated = False
    installs_package = True  # a cloud VM starts from the cloud's image: skyspot arrives as the mounted wheel
    start_seconds = 0.0  # not known here: a deadline plans a cloud restart with its prior (planning/deadline.py)

    def launch_question(self, rendered) -> str:
        return f"Launch '{rendered.recipe.name}' as SkyPilot managed job '{rendered.run_name}'?"

    def check(self, rendered) -> None:
        recipe = rendered.recipe
        sdk.check_launchable(
            rendered.task, recipe_name=recipe.name, clouds=list(recipe.resources.clouds), store=recipe.storage.store
        )

    def submit(self, rendered, *, detach: bool, deadline=None) -> int:
        from skyspot.executors.sky.submit import submit_cloud

        job_id = submit_cloud(rendered, detach=detach, deadline=deadline)
        what = "the deadline's controller (it runs the training on spot or on-demand)" if deadline else "managed job"
        err.print(f"submitted {what} as managed job {job_id} '{rendered.run_name}'; `skyspot status` follows it")
        return 0

    def refresh(self, runs):
        job_ids = [r.job_id for r in runs if r.job_id is not None]
        if not job_ids:
            return {}, None
        try:
            records = sdk.queue(job_ids)
        except SkyspotError as error:
            return {}, f"SkyPilot managed jobs were not refreshed ({error}); showing what the ledger and buckets hold"
        sdk.record_status(runs, records)
        return {r.name: sdk.placed(records[r.job_id]) for r in runs if r.job_id in records}, None

    def logs(self, run, *, follow: bool) -> int:
        return sdk.tail_logs(run.job_id, follow)

    def cancel(self, run, ledger) -> None:
        sdk.cancel(run.job_id)
        ledger.set_cancelled(run.name)
        err.print(f"cancelled managed job {run.job_id} ('{run.name}')")

    def resume_question(self, run) -> str:
        return f"Resume '{run.name}' as a new SkyPilot managed job?"

    def resume(self, run, *, detach: bool) -> int:
        from skyspot.executors.sky.submit import resume_cloud  # re-record, rebuild the wheel, resubmit

        job_id = resume_cloud(run, detach=detach)
        err.print(f"resumed '{run.name}' as managed job {job_id}; it continues from its newest durable checkpoint")
        return 0

    def deadline_inputs(self, run, plan, events):
        """The spot the deadline's controller observed (its stages' events), from the plan's start."""
        from skyspot.planning import deadline as dl
        from skyspot.executors import DeadlineInputs
        from skyspot.executors.sky.deadline import CLOUD_PROVISION_SECONDS

        t0 = float(plan["start"])
        return DeadlineInputs(
            trace=dl.observed_trace(events, t0),
            t0=t0,
            provision_seconds=CLOUD_PROVISION_SECONDS,
            restart_prior=dl.CLOUD_RESTART_PRIOR_SECONDS,
            notice_seconds=0.0,
            source="as the controller observed it",
        )


# The launch flags that only shape a local run (executors/local/executor.py FLAGS), as the command line
# spells them: a cloud launch given one is refused, so a fault meant for a rehearsal never rides along.
_LOCAL_FAULTS = {
    "preempt_every": "--preempt-every",
    "preempt_at_steps": "--preempt-at-steps",
    "spot_trace": "--spot-trace",
    "fallback_after": "--fallback-after",
    "spot_nodes": "--spot-nodes",
    "crash_at_steps": "--crash-at-steps",
    "hang_at_steps": "--hang-at-steps",
    "cut_link_at_steps": "--cut-link-at-steps",
    "netns": "--netns",
}


def executor(flags: Mapping[str, Any], recipe) -> SkyExecutor:
    """A launch's executor: SkyPilot takes no executor flags. The local ones that inject faults are refused
    (the simulated cloud's timings, `--notice`, `--grace`, `--provision-delay` and `--simulate`, mean nothing
    to a cloud run and are ignored, as they always were)."""
    if flags.get("fresh_node"):
        raise UsageError("--fresh-node is for local runs: add --local (a cloud node is always fresh)")
    given = [flag for key, flag in _LOCAL_FAULTS.items() if flags.get(key) is not None]
    if given:
        raise UsageError(
            f"{', '.join(given)} inject(s) faults into a local run: add --local, or leave it out for a cloud run"
        )
    return EXECUTOR


EXECUTOR = SkyExecutor()
