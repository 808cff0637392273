"""The local executor: run a rendered task on this machine, with injected preemptions and recovery.

`launch_local` records the run in the ledger, writes the controller's spec next to the
run, and starts the controller (skyspot/executors/local/controller.py) in its own
session, so a detached run survives the terminal. Attached, it follows the run until
it ends and returns the run's exit code. docs/local.md says what this emulates and what
it does not. `EXECUTOR` is its side of the executors' surface (skyspot/executors/__init__.py):
its log, its cancel (SIGTERM to the controller) and its resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from skyspot import clouds
from skyspot.console import err
from skyspot.errors import SkyspotError, UsageError
from skyspot.events import FileTail
from skyspot.executors.local import controller_lock, rank_faults
from skyspot.executors.local.liveness import controller_gone, controller_lock_unheld, gone_cause
from skyspot.ledger import Ledger, skyspot_home
from skyspot.ledger import new_run_name, record_launch
from skyspot.trainer.metrics.spot import PRICES_ENV
from skyspot.events import EventType as T

MAX_SECONDS = 7 * 86400.0
"""The longest a simulated wait may be (--notice, --grace, --provision-delay, --preempt-every): finite, and a week."""

# The controller (and the metadata stand-in it imports) loads only to start or resume a run: not for
# `status`, `logs` or `cancel`, which reach this module through the executor surface (about 40 ms).
if TYPE_CHECKING:
    from skyspot.executors.local.controller import Spec
    from skyspot.executors.local.spot_trace import SpotTrace


@dataclass
class LocalOptions:
    preempt_every: Optional[float] = None
    preempt_at_steps: list[int] = field(default_factory=list)
    spot_trace: Optional[str] = None
    notice: Optional[float] = None
    """The simulated cloud's notice window in seconds (scaled; docs/local.md); None: the cloud's own."""
    grace: Optional[float] = None
    """SIGTERM to SIGKILL: AWS's shutdown, and a cancel's; None: AWS's scaled with the window, 30 s for a cancel."""
    provision_delay: float = 2.0
    fallback_after: Optional[int] = None
    cloud: str = "aws"
    spot_nodes: list[int] = field(default_factory=list)
    fresh_node: bool = False
    deadline: Optional[dict] = None
    """launch --deadline: {at, start, policy, step_seconds_hint} (skyspot/app/launch.py plan_deadline)."""
    rank_faults: list[dict] = field(default_factory=list)
    """--crash-at-steps / --hang-at-steps / --cut-link-at-steps (executors/local/rank_faults.py parse)."""
    netns: bool = False
    """--netns: each node a host of its own, in a network namespace (executors/local/netns.py)."""


# The launch flags only a local run takes, by their name in a launch request (app/launch.py LaunchRequest's
# `executor_flags`), with how the command line spells them (for the messages).
FLAGS = {
    "preempt_every": "--preempt-every",
    "preempt_at_steps": "--preempt-at-steps",
    "spot_trace": "--spot-trace",
    "fallback_after": "--fallback-after",
    "spot_nodes": "--spot-nodes",
    "crash_at_steps": "--crash-at-steps",
    "hang_at_steps": "--hang-at-steps",
    "cut_link_at_steps": "--cut-link-at-steps",
    "netns": "--netns",
    "notice": "--notice",
    "grace": "--grace",
    "provision_delay": "--provision-delay",
    "simulate": "--simulate",
    "fresh_node": "--fresh-node",
}


def options_from_flags(flags: Mapping[str, Any], recipe) -> LocalOptions:
    """A local launch's options from its raw flags (`flags`: FLAGS' names; None or absent: the default),
    checked against the recipe (check_options) before anything is printed or started."""
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise ValueError(f"not local executor flags: {unknown}")
    given = {key: value for key, value in flags.items() if value is not None}
    options = LocalOptions(
        preempt_every=given.get("preempt_every"),
        preempt_at_steps=_steps(given.get("preempt_at_steps")),
        spot_trace=given.get("spot_trace"),
        notice=given.get("notice"),
        grace=given.get("grace"),
        provision_delay=given.get("provision_delay", LocalOptions.provision_delay),
        fallback_after=given.get("fallback_after"),
        cloud=given.get("simulate", LocalOptions.cloud),
        spot_nodes=_node_counts(given.get("spot_nodes")),
        fresh_node=bool(given.get("fresh_node")),
        rank_faults=sorted(
            rank_faults.parse(given.get("crash_at_steps"), "crash")
            + rank_faults.parse(given.get("hang_at_steps"), "hang")
            + rank_faults.parse(given.get("cut_link_at_steps"), "cut"),
            key=lambda f: f["step"],
        ),
        netns=bool(given.get("netns")),
    )
    check_options(options, recipe, deadline=bool(recipe.resources.deadline))
    return options


def _steps(value: Optional[str]) -> list[int]:
    if not value:
        return []
    try:
        steps = sorted(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"--preempt-at-steps '{value}' must be comma-separated step numbers, e.g. 15,40") from None
    if any(s < 1 for s in steps):
        raise UsageError("--preempt-at-steps takes steps >= 1")
    return steps


def _node_counts(value: Optional[str]) -> list[int]:
    if not value:
        return []
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--spot-nodes '{value}' must be comma-separated node counts, e.g. 2,1,2") from None
    if not counts or any(n < 1 for n in counts):
        raise UsageError("--spot-nodes takes node counts >= 1")
    return counts


def _instance_for(built, cloud: str) -> tuple[str, Optional[str]]:
    """The instance type a local node stands for: the recipe's cheapest candidate on that cloud,
    or for CPU recipes a stand-in GPU instance (priced by the cost report as 'simulated')."""
    cheapest: dict[str, Any] = {}  # the first (cheapest) candidate with an instance type, per cloud
    for candidate in built.candidates:
        if candidate.instance_type:
            cheapest.setdefault(candidate.cloud, candidate)
    if cloud in cheapest:
        return cheapest[cloud].instance_type, cheapest[cloud].accelerators
    return clouds.get(cloud).simulated.stand_in, None


def check_options(options: LocalOptions, recipe, *, deadline: bool) -> tuple["SpotTrace", list[int]]:
    """Everything a local launch refuses in its options, given the recipe (`deadline`: the run has one),
    before anything is printed or started; the spot trace and the spot node counts they give. A dry
    run makes the same checks (cli/launch.py)."""
    from skyspot.executors.local.spot_trace import SpotTrace

    if options.cloud not in clouds.names():
        raise UsageError(f"--simulate '{options.cloud}' is not one of {', '.join(clouds.names())}")
    chosen = [o for o in ("preempt_every", "preempt_at_steps", "spot_trace") if getattr(options, o)]
    if len(chosen) > 1:
        raise UsageError("use one of --preempt-every, --preempt-at-steps and --spot-trace")
    if options.preempt_every is not None and not 0 < options.preempt_every <= MAX_SECONDS:
        raise UsageError(f"--preempt-every takes seconds > 0, at most {MAX_SECONDS:.0f} (a week)")
    for value, flag in (
        (options.notice, "--notice"),
        (options.grace, "--grace"),
        (options.provision_delay, "--provision-delay"),
    ):
        # `not 0 <= value`: NaN too. The controller waits these out (Event.wait, which an inf or 1e308
        # overflows) and a grace that never ends never kills a trainer that ignores SIGTERM.
        if value is not None and not 0 <= value <= MAX_SECONDS:
            raise UsageError(f"{flag} takes seconds from 0 to {MAX_SECONDS:.0f} (a week)")
    trace = SpotTrace.load(options.spot_trace) if options.spot_trace else SpotTrace()
    from skyspot.executors.local.rank_faults import check as check_faults

    check_faults(options.rank_faults, recipe.resources.num_nodes, recipe.resources.cpu_ranks or 1)
    if any(f["action"] == "cut" for f in options.rank_faults) and not options.netns:
        raise UsageError("--cut-link-at-steps needs --netns: a link to cut is a namespace's (executors/local/netns.py)")
    if options.netns:
        from skyspot.executors.local.netns import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise UsageError(f"--netns: {reason}")
    if deadline and options.fallback_after is not None:
        raise UsageError(
            "--fallback-after and a deadline both decide when to run on-demand: drop --fallback-after "
            "(the deadline's policy switches when the run falls behind)"
        )
    if trace.zones:
        if deadline:
            raise UsageError(
                f"{options.spot_trace}: a zoned trace places recoveries by resources.placement; a deadline's "
                "policy does not read zones yet: use a trace without zones for --deadline"
            )
        others = sorted({z.cloud for z in trace.zones} - {options.cloud})
        if others:
            raise UsageError(
                f"{options.spot_trace}: zones on {', '.join(others)}, but the simulated cloud is {options.cloud}: "
                f"pass --simulate {others[0]} or give zones of {options.cloud} only"
            )
    if options.spot_nodes and trace.nodes:
        raise UsageError("give spot node counts once: --spot-nodes or the trace's 'nodes'")
    spot_nodes = list(options.spot_nodes or trace.nodes)
    where = "--spot-nodes" if options.spot_nodes else options.spot_trace
    resources = recipe.resources
    if spot_nodes:
        low, high = resources.fewest_nodes, resources.num_nodes
        above = [n for n in spot_nodes if n > high]
        if above:
            raise UsageError(
                f"{where}: {', '.join(map(str, above))} node(s) above resources.num_nodes ({high}); "
                "a spot grant is at most the recipe's nodes"
            )
        below = [n for n in spot_nodes if n < low]
        if below:
            raise UsageError(
                f"{where}: {', '.join(map(str, below))} node(s) outside {low}..{high} "
                "(resources.min_nodes..resources.num_nodes); set resources.min_nodes to allow fewer"
            )
    return trace, spot_nodes


def make_spec(built, name: str, options: LocalOptions) -> Spec:
    from skyspot.executors.local.controller import Spec

    trace, spot_nodes = check_options(options, built.recipe, deadline=bool(options.deadline))
    instance_type, accelerators = _instance_for(built, options.cloud)
    recovery = built.task["resources"]["job_recovery"]
    envs = {k: str(v) for k, v in built.task.get("envs", {}).items()}
    if PRICES_ENV in envs:  # the dashboards' cost curve: priced as the simulated placement, as cost-report does
        envs[PRICES_ENV] = _simulated_prices(options.cloud, instance_type, [z.region for z in trace.zones])
    return Spec(
        name=name,
        recipe=built.recipe.name,
        run_script=built.task["run"],
        task_envs=envs,
        num_nodes=built.recipe.resources.num_nodes,
        total_steps=built.recipe.train.steps,
        cloud=options.cloud,
        instance_type=instance_type,
        accelerators=accelerators,
        max_restarts_on_errors=int(recovery.get("max_restarts_on_errors", 0)),
        preempt_every=options.preempt_every,
        preempt_at_steps=list(options.preempt_at_steps),
        trace_times=trace.preemptions,
        capacity_gone_after=trace.capacity_gone_after,
        spot_nodes=spot_nodes,
        notice=trace.notice if trace.notice is not None else options.notice,
        grace=options.grace,
        provision_delay=options.provision_delay,
        fallback_after=options.fallback_after,
        unavailable=[[start, end] for start, end in trace.unavailable],
        deadline=options.deadline,
        fresh_node=options.fresh_node,
        setup_script=built.task.get("setup", "") if options.fresh_node else "",
        rank_faults=list(options.rank_faults),
        netns=options.netns,
        zones=[zone.as_dict() for zone in trace.zones],
        placement=built.recipe.resources.placement,
        burst_s=built.recipe.resources.burst_minutes * 60.0,
        file_mounts=_local_mounts(built) if options.fresh_node else {},
    )


def _simulated_prices(cloud: str, instance_type: str, zone_regions: Sequence[str] = ()) -> str:
    """SKYSPOT_PRICES for the simulated placement: its instance at spot and on-demand list prices, in the
    simulated region and in each region a zoned trace places spot attempts in."""
    from skyspot.pricing.prices import hourly_price

    rows = []
    for region, spot in dict.fromkeys(
        [(clouds.get(cloud).simulated.region, s) for s in (True, False)] + [(r, True) for r in zone_regions]
    ):
        try:
            price = hourly_price(cloud, instance_type=instance_type, region=region, spot=spot)
        except UsageError:  # no such price (MissingPrice is one): no cost curve for that capacity
            continue
        rows.append(
            {
                "cloud": cloud,
                "region": region,
                "instance_type": instance_type,
                "spot": spot,
                "usd_per_hour": price.usd_per_hour,
            }
        )
    return json.dumps(rows, separators=(",", ":"))


def _local_mounts(built) -> dict[str, str]:
    mounts = {t: s for t, s in (built.task.get("file_mounts") or {}).items() if isinstance(s, str) and "://" not in s}
    if built.package is None:
        raise UsageError("a fresh node needs the skyspot wheel: build the task with a package")
    return mounts


CANCEL_WAIT_S = 300
"""How long `cancel` waits for a live controller's emergency checkpoint and stop."""


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
    record_launch(
        name,
        built,
        "local",
        run_dir=str(run_dir),
        info={
            "candidates": [asdict(c) for c in built.candidates],
            "cloud": options.cloud,
            "instance_type": spec.instance_type,
            "log": str(run_dir / "logs" / "run.log"),
            **({"deadline": options.deadline} if options.deadline else {}),
        },
    )
    with Ledger() as ledger:
        try:
            run_dir.mkdir(mode=0o700)
            (run_dir / "logs").mkdir(mode=0o700)
        except OSError as error:  # never leave a PENDING row behind for a run that cannot start
            ledger.set_failed(name)
            raise UsageError(f"cannot create the run directory {run_dir}: {error.strerror}") from None
        _write_spec(run_dir, spec, exclusive=True)
        _start_controller(name, run_dir, ledger)
    return name


def _write_spec(run_dir: Path, spec: Spec, *, exclusive: bool) -> None:
    path = run_dir / "local.json"
    target = path if exclusive else run_dir / f".local.json.{os.getpid()}"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(spec), handle, indent=2)
    if not exclusive:
        os.replace(target, path)


def _start_controller(name: str, run_dir: Path, ledger: Ledger, *, resumed: bool = False) -> None:
    """Start the run's controller; a resume's PENDING goes to the ledger once its lock is held (never a
    not-ended row with an unheld lock, which `refresh` would take for a dead controller)."""
    # The lock is taken here and handed to the controller, so it is held from the controller's first
    # instant: `cancel` and `resume` know the run by the lock, never by the PID alone (executors/local/controller_lock.py).
    lock = controller_lock.acquire(run_dir)
    try:
        if resumed:
            ledger.set_resumed(name)
        controller_log = os.open(run_dir / "logs" / "controller.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        proc = subprocess.Popen(
            [sys.executable, "-m", "skyspot.executors.local.controller", name],
            stdin=subprocess.DEVNULL,
            stdout=controller_log,
            stderr=controller_log,
            start_new_session=True,
            pass_fds=(lock,),
            env={**os.environ, "PYTHONUNBUFFERED": "1", controller_lock.FD_ENV: str(lock)},
        )
        os.close(controller_log)
        controller_lock.record(lock, proc.pid)
    finally:
        os.close(lock)  # the controller's copy keeps the lock held
    ledger.set_controller(name, proc.pid)


def resume_local(run, *, detach: bool) -> int:
    """Start a stopped local run again under its own name: its newest checkpoint, its run dir.

    Preemptions injected at launch (--preempt-*, a trace) are not replayed: they belonged to
    that launch's timeline."""
    if not run.terminal and controller_lock.is_held(run.run_dir):
        raise UsageError(
            f"run '{run.name}' is still {run.status}; `skyspot logs {run.name} -f` follows it, "
            f"`skyspot cancel {run.name}` stops it"
        )
    from skyspot.executors.local.controller import Spec

    run_dir = Path(run.run_dir or "")
    try:
        spec = Spec(**json.loads((run_dir / "local.json").read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(
            f"run '{run.name}' cannot be resumed: its spec {run_dir / 'local.json'} is unreadable "
            f"({getattr(error, 'strerror', None) or error})"
        ) from None
    spec = replace(
        spec,
        preempt_every=None,
        preempt_at_steps=[],
        trace_times=[],
        capacity_gone_after=None,
        spot_nodes=[],
        fallback_after=None,
        unavailable=[],
        zones=[],
    )
    _write_spec(run_dir, spec, exclusive=False)
    with Ledger() as ledger:
        _start_controller(run.name, run_dir, ledger, resumed=True)
    return _attach(run.name, detach, verb="resumed")


def launch_local(built, *, name: Optional[str], detach: bool, options: LocalOptions) -> int:
    name = start(built, name=name, options=options)
    return _attach(name, detach, verb="launched")


def _attach(name: str, detach: bool, *, verb: str) -> int:
    if detach:
        err.print(f"{verb} '{name}' locally in the background; `skyspot status` and `skyspot logs {name} -f` follow it")
        return 0
    from skyspot.executors.local.follow import follow

    return follow(name)


class LocalExecutor:
    """Local runs behind the executors' surface: their controller keeps the ledger's status itself."""

    name = "local"
    local_events = True
    runs_here = True
    simulated = True

    def __init__(self, options: Optional[LocalOptions] = None) -> None:
        self.options = options or LocalOptions()

    @property
    def installs_package(self) -> bool:
        """A fresh local node installs skyspot from the wheel built here, as a cloud node does; otherwise the
        nodes use the skyspot installed here."""
        return self.options.fresh_node

    @property
    def start_seconds(self) -> float:
        """What a (re)start of this run's nodes takes before the trainer runs: the simulated provisioning."""
        return self.options.provision_delay

    def launch_question(self, rendered) -> None:
        return None  # nothing is paid for

    def check(self, rendered) -> None:
        make_spec(rendered, rendered.run_name or "check", self.options)  # the options' refusals, nothing started

    def submit(self, rendered, *, detach: bool, deadline=None) -> int:
        options = replace(self.options, deadline=deadline) if deadline is not None else self.options
        return launch_local(rendered, name=rendered.run_name, detach=detach, options=options)

    def refresh(self, runs):
        """The controllers keep the ledger's status themselves; one that died without a word is marked
        FAILED_CONTROLLER here (`controller_gone`)."""
        if not any(controller_lock_unheld(run) for run in runs):
            return {}, None
        with Ledger() as ledger:
            try:
                for run in runs:
                    if controller_gone(ledger, run):
                        run.status, run.info = "FAILED_CONTROLLER", ledger.get(run.name).info
            except Exception:  # a read-only or busy ledger: the next command tries again
                pass
        return {}, None

    def logs(self, run, *, follow: bool) -> int:
        if not run.run_dir:
            raise SkyspotError(f"run '{run.name}' has no local run directory in the ledger, so no log to show")
        tail = FileTail(Path(run.run_dir) / "logs" / "run.log")
        with Ledger() as ledger:
            while True:
                _copy_new(tail)
                now = ledger.get(run.name)
                if follow and controller_gone(ledger, now):
                    _copy_new(tail)
                    err.print(
                        f"run '{run.name}' FAILED_CONTROLLER: {gone_cause(run.name)}", markup=False, highlight=False
                    )
                    return 1
                if not follow or now.terminal:
                    _copy_new(tail)
                    return 0
                time.sleep(0.5)

    def cancel(self, run, ledger) -> None:
        held, pid = controller_lock.state(run.run_dir)
        give_up = time.monotonic() + 3.0
        while held and pid is None and time.monotonic() < give_up:  # a controller starting this instant
            time.sleep(0.1)
            held, pid = controller_lock.state(run.run_dir)
        if held and pid is None:
            raise SkyspotError(
                f"run '{run.name}': a process holds its controller's lock "
                f"{controller_lock.lock_path(run.run_dir)} but is not the controller it names; "
                "nothing was signalled"
            )
        if not held:  # never signal a bare PID: it may be a stranger's now (executors/local/controller_lock.py)
            ledger.set_cancelled(run.name)
            stranger = (
                f" (pid {run.controller_pid}, recorded for it, is not its controller now and was not signalled)"
                if run.controller_pid
                else ""
            )
            err.print(f"run '{run.name}' had no live controller; marked CANCELLED{stranger}", markup=False)
            return
        ledger.set_cancelling(run.name)
        try:
            os.kill(pid, signal.SIGTERM)  # the controller checkpoints, stops, marks CANCELLED
        except ProcessLookupError:
            pass  # it ended in between: the wait below sees the lock released
        deadline = time.time() + CANCEL_WAIT_S
        while time.time() < deadline and not ledger.get(run.name).terminal:
            if not controller_lock.is_held(run.run_dir):
                if ledger.set_cancelled(run.name, unless_ended=True):  # it died without saying so: say it for it
                    err.print(
                        f"run '{run.name}': its controller ended without recording it; marked CANCELLED", markup=False
                    )
                    return
                break
            time.sleep(0.2)
        err.print(f"run '{run.name}' {ledger.get(run.name).status}", markup=False)

    def resume_question(self, run) -> None:
        return None  # nothing is paid for

    def resume(self, run, *, detach: bool) -> int:
        return resume_local(run, detach=detach)

    def deadline_inputs(self, run, plan, events):
        """The run's own spot trace, replayed from its first attempt, with the spec's provisioning and notice."""
        from skyspot.planning import deadline as dl
        from skyspot.executors import DeadlineInputs
        from skyspot.executors.local.spot_trace import SpotTrace

        from skyspot.events import read_regular

        try:  # read_regular: a FIFO or a device put there never hangs the report
            spec = json.loads(read_regular(Path(run.run_dir or "") / "local.json") or b"")
        except (OSError, ValueError):
            raise UsageError("the run's local.json is unreadable") from None
        starts = [e["ts"] for e in events if e.get("type") == T.ATTEMPT_START]
        provision = float(spec.get("provision_delay") or 0.0)
        return DeadlineInputs(
            trace=SpotTrace.from_spec(spec),
            t0=min(starts) if starts else float(plan["start"]),
            provision_seconds=provision,
            restart_prior=provision + dl.LOCAL_START_PRIOR_SECONDS,
            notice_seconds=float(spec.get("notice") or 0.0),
            source="replayed from the run's spot trace",
        )


def _copy_new(tail: FileTail) -> None:
    data = tail.read(whole_lines=False)
    if data:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
        sys.stdout.flush()


EXECUTOR = LocalExecutor()


def executor(flags: Mapping[str, Any], recipe) -> LocalExecutor:
    """A launch's local executor, with that launch's options (injected preemptions, the simulated cloud...)
    built from its raw flags (options_from_flags)."""
    return LocalExecutor(options_from_flags(flags, recipe))
