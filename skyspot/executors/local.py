"""The local executor: run a rendered task on this machine, with injected preemptions and recovery.

`launch_local` records the run in the ledger, writes the controller's spec next to the
run, and starts the controller (skyspot/executors/local_controller.py) in its own
session, so a detached run survives the terminal. Attached, it follows the run until
it ends and returns the run's exit code. docs/local.md says what this emulates and what
it does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from skyspot.errors import UsageError
from skyspot.executors.local_controller import SIMULATED_PLACES, Spec
from skyspot.ledger import Ledger, skyspot_home
from skyspot.runs import new_run_name


@dataclass
class LocalOptions:
    preempt_every: Optional[float] = None
    preempt_at_steps: list[int] = field(default_factory=list)
    spot_trace: Optional[str] = None
    notice: float = 30.0
    grace: float = 30.0
    provision_delay: float = 2.0
    fallback_after: Optional[int] = None
    cloud: str = "aws"
    spot_nodes: list[int] = field(default_factory=list)


def _instance_for(built, cloud: str) -> tuple[str, Optional[str]]:
    """The instance type a local node stands for: the recipe's cheapest candidate on that cloud,
    or for CPU recipes a stand-in GPU instance (priced by the cost report as 'simulated')."""
    for candidate in built.candidates:
        if candidate.cloud == cloud and candidate.instance_type:
            return candidate.instance_type, candidate.accelerators
    return SIMULATED_PLACES[cloud]["stand_in"], None


def make_spec(built, name: str, options: LocalOptions) -> Spec:
    from skyspot.executors.spot_trace import SpotTrace

    if options.cloud not in SIMULATED_PLACES:
        raise UsageError(f"--simulate '{options.cloud}' is not one of {', '.join(SIMULATED_PLACES)}")
    chosen = [o for o in ("preempt_every", "preempt_at_steps", "spot_trace") if getattr(options, o)]
    if len(chosen) > 1:
        raise UsageError("use one of --preempt-every, --preempt-at-steps and --spot-trace")
    if options.preempt_every is not None and options.preempt_every <= 0:
        raise UsageError("--preempt-every takes seconds > 0")
    for value, flag in ((options.notice, "--notice"), (options.grace, "--grace"),
                        (options.provision_delay, "--provision-delay")):
        if value < 0:
            raise UsageError(f"{flag} takes seconds >= 0")
    trace = SpotTrace.load(options.spot_trace) if options.spot_trace else SpotTrace()
    if options.spot_nodes and trace.nodes:
        raise UsageError("give spot node counts once: --spot-nodes or the trace's 'nodes'")
    spot_nodes = list(options.spot_nodes or trace.nodes)
    where = "--spot-nodes" if options.spot_nodes else options.spot_trace
    resources = built.recipe.resources
    if spot_nodes:
        low, high = resources.fewest_nodes, resources.num_nodes
        above = [n for n in spot_nodes if n > high]
        if above:
            raise UsageError(f"{where}: {', '.join(map(str, above))} node(s) above resources.num_nodes ({high}); "
                             "a spot grant is at most the recipe's nodes")
        below = [n for n in spot_nodes if n < low]
        if below:
            raise UsageError(f"{where}: {', '.join(map(str, below))} node(s) outside {low}..{high} "
                             "(resources.min_nodes..resources.num_nodes); set resources.min_nodes to allow fewer")
    instance_type, accelerators = _instance_for(built, options.cloud)
    recovery = built.task["resources"]["job_recovery"]
    return Spec(
        name=name, recipe=built.recipe.name, run_script=built.task["run"],
        task_envs={k: str(v) for k, v in built.task.get("envs", {}).items()},
        num_nodes=built.recipe.resources.num_nodes, total_steps=built.recipe.train.steps,
        cloud=options.cloud, instance_type=instance_type, accelerators=accelerators,
        max_restarts_on_errors=int(recovery.get("max_restarts_on_errors", 0)),
        preempt_every=options.preempt_every, preempt_at_steps=list(options.preempt_at_steps),
        trace_times=trace.preemptions, capacity_gone_after=trace.capacity_gone_after, spot_nodes=spot_nodes,
        notice=trace.notice if trace.notice is not None else options.notice, grace=options.grace,
        provision_delay=options.provision_delay, fallback_after=options.fallback_after,
    )


def runs_dir() -> Path:
    path = skyspot_home() / "runs"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def start(built, *, name: Optional[str], options: LocalOptions) -> str:
    """Record the run, write its spec and start its controller; returns the run name."""
    name = name or new_run_name(built.recipe.name)
    spec = make_spec(built, name, options)
    run_dir = runs_dir() / name
    if run_dir.exists():
        raise UsageError(f"a run named '{name}' exists already ({run_dir}); pick another -n/--name")
    ledger = Ledger()
    try:
        ledger.add(name, built.recipe.name, "local", status="PENDING", run_dir=str(run_dir),
                   store=built.recipe.storage.store, total_steps=built.recipe.train.steps,
                   num_nodes=built.recipe.resources.num_nodes,
                   info={"candidates": [asdict(c) for c in built.candidates], "cloud": options.cloud,
                         "instance_type": spec.instance_type, "log": str(run_dir / "logs" / "run.log"),
                         "recipe_fingerprint": built.recipe.fingerprint()})
        try:
            run_dir.mkdir(mode=0o700)
            (run_dir / "logs").mkdir(mode=0o700)
        except OSError as error:  # never leave a PENDING row behind for a run that cannot start
            ledger.update(name, status="FAILED", exit_code=1)
            raise UsageError(f"cannot create the run directory {run_dir}: {error.strerror}") from None
        spec_path = run_dir / "local.json"
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(spec), handle, indent=2)
        controller_log = os.open(run_dir / "logs" / "controller.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        proc = subprocess.Popen([sys.executable, "-m", "skyspot.executors.local_controller", name],
                                stdin=subprocess.DEVNULL, stdout=controller_log, stderr=controller_log,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(controller_log)
        ledger.update(name, controller_pid=proc.pid)
    finally:
        ledger.close()
    return name


def launch_local(built, *, name: Optional[str], detach: bool, options: LocalOptions) -> int:
    from skyspot.cli.common import err

    name = start(built, name=name, options=options)
    if detach:
        err.print(f"launched '{name}' locally in the background; `skyspot status` and `skyspot logs {name} -f` follow it")
        return 0
    from skyspot.executors.follow import follow

    return follow(name)
