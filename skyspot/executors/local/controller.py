"""The local controller: runs one local run to the end, as SkyPilot's managed-jobs controller would.

Over 500 lines because it is one loop, the attempt's life (provision, start, watch, preempt, recover),
and each of its steps shares that loop's state; the policies it calls live elsewhere (executors/local/spot_trace.py,
executors/local/deadline.py, executors/local/metadata_server.py). The attempt is an explicit state machine:
its stages and what it knows are executors/local/attempt.py; here, one function per transition, WATCH (what
each stage watches for, checked in ORDER every poll) and AFTER_ATTEMPT (an attempt's outcome -> the next step).

    python -m skyspot.executors.local.controller RUN_NAME

It is started by `skyspot launch --local` in its own session (so a run survives the
terminal) and does, per attempt:

1. "provision" a node group (waits --provision-delay after a preemption), choosing spot or,
   after --fallback-after preemptions or when the trace says capacity is gone, on-demand;
2. start the task's `run` script once per node, each in its own process group, with the
   environment a SkyPilot node sees (SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES,
   SKYPILOT_NUM_GPUS_PER_NODE, a SKYPILOT_TASK_ID stable across recoveries, SKYPILOT_CLUSTER_INFO
   naming the simulated cloud) and the metadata endpoints pointed at a loopback server;
3. inject rank faults (`--crash-at-steps`, `--hang-at-steps`: executors/local/rank_faults.py), which the
   node recovers from in place, and preemptions on the simulated cloud's own timeline (`Timeline`, docs/local.md): a notice
   through that metadata server, then SIGTERM and SIGKILL when that cloud sends them (AWS: SIGTERM
   at the notice's `time`, two minutes on, then a short shutdown; GCP: SIGTERM with the notice, hard
   off 30 s later; Azure: no SIGTERM, the VM gone at the Preempt's NotBefore), all scaled by `--notice`;
4. recover (exit code 75 or a preemption it injected), retry other errors up to the task's
   max_restarts_on_errors, or finish (SUCCEEDED, FAILED, CANCELLED). A configuration error (exit 2)
   or no usable checkpoint (exit 3) is not retried: a restart meets the same recipe, store and
   checkpoints. Every ending says why, from the trainer's exit record.

On a machine that has never built DeepSpeed's CPU communication op, the first attempt builds it
before the trainer starts (what the task's setup does on a cloud node) and says so, rather than
letting the trainer's first start sit silent for a minute or more.

`setup` is skipped by default: the controller runs the trainer from the very environment
skyspot is installed in, which is what the setup script would produce. With `fresh_node`
(`launch --local --fresh-node`) the node is a new virtual environment with no skyspot
(executors/local/fresh_node.py): the task's file mounts are copied in and its `setup` runs at the
start of every attempt, as SkyPilot runs it on every newly provisioned VM; a failed setup
ends the run FAILED_SETUP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Optional

from skyspot.attempts import AttemptEnd as End
from skyspot.clouds import NOTICE_WINDOWS_S, get as cloud_facts
from skyspot.events import EVENTS_DIR, EventWriter, FileTail, read_events_dir
from skyspot.errors import EXIT_USAGE, UsageError
from skyspot.executors.local import controller_lock
from skyspot.executors.local.attempt import ENDED_BY, Attempt, Ending, Stage
from skyspot.executors.local.handover import Handover
from skyspot.ledger import Ledger
from skyspot.executors.local.spot_trace import SpotTrace
from skyspot.planning.deadline import SPOT
from skyspot.ports import free_port
from skyspot.trainer.parent_death import set_parent_death_signal
from skyspot.trainer.exit_codes import EXIT_RECORD, NO_VALID_CHECKPOINT, STALE, USAGE
from skyspot.trainer.exit_codes import PREEMPTED as RECOVER_EXIT_CODE

POLL_SECONDS = 0.2
# Endings a restart cannot fix (trainer/exit_codes.py): the next attempt meets the same recipe, store and checkpoints.
NOT_RETRIED = {
    USAGE: "a configuration error",
    NO_VALID_CHECKPOINT: "no usable checkpoint",
    # Another attempt (another controller, on another machine) took the run's store: a restart here would
    # take it back and fence that one off in turn (trainer/fence.py); this controller leaves the run to it.
    STALE: "a newer attempt holding the run's store",
}
CAUSE_CHARS = 400
FAIL_SETUP_ENV = "SKYSPOT_TEST_FAIL_SETUP"
"""Tests only: a comma-separated list of simulated clouds (aws, gcp, azure) whose setup fails at once, on a
fresh node or not: how a rehearsal that finds a broken image is tested (tests/app/test_rehearse.py)."""
# DeepSpeed's CPU communication op (ShareMemCommBuilder.NAME), JIT-built on first use (trainer/prepare.py).
SHM_OP = "deepspeed_shm_comm"


# How the simulated clouds take a spot VM back, in seconds after the notice (the windows: clouds.py).
AWS_SHUTDOWN_S = 30.0  # ours: AWS publishes no figure for how long the OS shutdown at the notice's `time` may run
STOP_GRACE_S = 30.0  # ours: SIGTERM to SIGKILL when the controller stops a node itself (cancel, a deadline's switch)


@dataclass(frozen=True)
class Timeline:
    """What the simulated cloud does to a spot VM it takes back, in seconds after the notice.

    The cloud's own shape, scaled by `scale` (the `--notice` window over the cloud's): AWS announces
    `time` two minutes ahead, the OS gets SIGTERM then and is off a short shutdown later; GCP sets
    `preempted` and sends the ACPI soft-off (SIGTERM) together, hard off 30 s later; Azure schedules a
    Preempt with NotBefore at least 30 s ahead and evicts the VM then, with no signal.
    """

    cloud: str
    window: float
    """Notice to the cloud's deadline: AWS's `time`, GCP's hard off, Azure's NotBefore."""
    sigterm_after: Optional[float]
    """Notice to SIGTERM; None: the cloud sends none (Azure)."""
    kill_after: float
    """Notice to SIGKILL: the VM is gone."""
    poll_seconds: float
    """The watcher's period (SKYSPOT_NOTICE_POLL_SECONDS): the cloud's, scaled with the window."""
    scale: float


def timeline_for(cloud: str, notice: Optional[float] = None, grace: Optional[float] = None) -> Timeline:
    """The preemption timeline of `cloud`, its window `notice` seconds (None: the cloud's own).

    `grace` replaces AWS's shutdown after SIGTERM (else it scales with the window); GCP and Azure have
    no such step: their hard off is the window itself.
    """
    own = NOTICE_WINDOWS_S[cloud]
    window = own if notice is None else float(notice)
    scale = window / own
    # The cloud's own period (for GCP's hanging GET, its retry period), scaled with the window but never
    # below the cloud's floor for a simulated node (clouds.SimulatedPlace.min_poll_s).
    facts = cloud_facts(cloud)
    poll = max(facts.simulated.min_poll_s, facts.notice_poll_s * min(1.0, scale))
    if cloud_facts(cloud).sigterm == "at_deadline":
        shutdown = AWS_SHUTDOWN_S * scale if grace is None else float(grace)
        return Timeline(cloud, window, window, window + shutdown, poll, scale)
    if cloud_facts(cloud).sigterm == "with_notice":
        return Timeline(cloud, window, 0.0, window, poll, scale)
    return Timeline(cloud, window, None, window, poll, scale)


@dataclass
class Spec:
    """What `launch --local` hands the controller (local.json in the run root; never secrets)."""

    name: str
    recipe: str
    run_script: str
    task_envs: dict[str, str]
    num_nodes: int
    total_steps: int
    cloud: str
    instance_type: str
    accelerators: Optional[str]
    max_restarts_on_errors: int
    preempt_every: Optional[float] = None
    preempt_at_steps: list[int] = field(default_factory=list)
    trace_times: list[float] = field(default_factory=list)
    capacity_gone_after: Optional[int] = None
    spot_nodes: list[int] = field(default_factory=list)
    """Nodes granted to each spot attempt in turn (the last repeats); empty: num_nodes."""
    notice: Optional[float] = None
    """The simulated cloud's notice window, scaled (docs/local.md); None: the cloud's own."""
    grace: Optional[float] = None
    """SIGTERM to SIGKILL on AWS's timeline and when the controller stops a node; None: the defaults."""
    provision_delay: float = 2.0
    fallback_after: Optional[int] = None
    notice_poll_seconds: Optional[float] = None
    """The watchers' period; None: the simulated cloud's, scaled with the window (Timeline)."""
    fresh_node: bool = False
    setup_script: str = ""
    file_mounts: dict[str, str] = field(default_factory=dict)
    """Local file mounts of the task (target -> source), copied onto a fresh node."""
    prepare_script: str = "python -m skyspot.trainer.prepare"
    """Run once before the first attempt when DeepSpeed's CPU op is not built yet (the setup's last step)."""
    unavailable: list[list[float]] = field(default_factory=list)
    """The trace's spot outages [start, end), seconds after launch."""
    deadline: Optional[dict] = None
    """launch --deadline: {at, start, policy, step_seconds_hint, period} (executors/local/deadline.py)."""
    rank_faults: list[dict] = field(default_factory=list)
    """--crash-at-steps / --hang-at-steps / --cut-link-at-steps: {action, step, node, local_rank} in step
    order (rank_faults.py)."""
    netns: bool = False
    """--netns: each node runs in a network namespace of its own, with its own address (netns.py)."""
    zones: list[dict] = field(default_factory=list)
    """A zoned trace's places (spot_trace.Zone.as_dict), where each spot attempt is placed (zones.py)."""
    placement: str = "expected_cost"
    """resources.placement: how a zoned trace's spot attempts choose their zone (zones.py)."""
    burst_s: float = 1800.0
    """resources.burst_minutes in seconds: how long a spot instance taken counts against its place (zones.py)."""


class Controller:
    def __init__(self, run_dir: Path, spec: Spec, ledger: Ledger):
        self.run_dir = run_dir
        self.spec = spec
        self.ledger = ledger
        self.cancel = threading.Event()
        self.preemptions = 0
        self.errors = 0
        self.spot_attempts = 0
        self.launched_at = time.time()
        self.log_path = run_dir / "logs" / "run.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.log: IO[str] = os.fdopen(fd, "a", buffering=1, encoding="utf-8")
        self._log_lock = threading.Lock()
        self.pending_steps = list(spec.preempt_at_steps)
        self.pending_faults = list(spec.rank_faults)
        self.fault_due = False  # the next rank fault's step was logged; it fires once its rank is found
        # After a crash or hang, the next fault waits for the workers that replace the struck ones (their
        # `start` event): the struck generation's last step events, or a kill of a worker torchrun is still
        # starting, would spend two faults on one failure (the in-place budget would see one).
        self.fault_armed = True
        # An outage starts with a notice to the spot instance running then, like a preemption.
        self.trace = SpotTrace.from_spec(spec)
        self.pending_trace = self.trace.losses()  # a zoned trace: the placed zone's, from its placement on
        self.placer = None  # a zoned trace's placement (zones.Placer)
        self.zone = None  # the zone of the current spot attempt (spot_trace.Zone), with a zoned trace
        if self.trace.zones:
            from skyspot.executors.local.zones import Placer, snapshot_prices

            self.placer = Placer(
                self.trace.zones,
                policy=spec.placement,
                prices=snapshot_prices(self.trace.zones, spec.instance_type),
                burst_s=spec.burst_s,
            )
            self.pending_trace = []
        self.fresh = None  # the fresh node (fresh_node.FreshNode) when spec.fresh_node
        self.attempt = 0  # the last attempt number used
        self.prepared = spec.fresh_node  # a fresh node's setup prepares it
        self.last_cause: Optional[str] = None  # the last line a node printed that says why it stopped
        self.planner = None  # the deadline's policy (executors/local/deadline.py) when spec.deadline
        self.hosts = None  # with spec.netns: the nodes' network namespaces (netns.Hosts), for the whole run
        self.spot_seconds = 0.0  # spot time so far: the preemption rate the way back to spot weighs
        self.back = None  # the way back to spot (return_to_spot.py), for a run without a deadline
        self.handover = Handover(self)  # make-before-break: the next node made ready while an attempt trains
        self.timeline = timeline_for(spec.cloud, spec.notice, spec.grace)
        self.stop_grace = STOP_GRACE_S if spec.grace is None else spec.grace
        if spec.deadline:
            from skyspot.executors.local.deadline import Planner

            self.planner = Planner(self)
        else:
            from skyspot.executors.local.return_to_spot import ReturnToSpot

            self.back = ReturnToSpot(self)

    # ------------------------------------------------------------------ helpers
    def say(self, line: str) -> None:
        with self._log_lock:
            self.log.write(f"[skyspot local] {time.strftime('%H:%M:%S')} {line}\n")

    def spot_available(self) -> bool:
        spec = self.spec
        if spec.fallback_after is not None and self.preemptions >= spec.fallback_after:
            return False
        return self.trace.available(time.time() - self.launched_at, self.preemptions)

    def next_attempt_number(self) -> int:
        """One past the last attempt: ours, or the trainer's (it numbers each start in its run root or
        store, and a resumed run continues its count). An attempt whose trainer failed before counting
        (a bad store, say) still takes a number, and the trainer's local counter is moved up to match,
        so its next start logs under the same number as the executor's events."""
        seen = [
            e.get("attempt", 0) for e in read_events_dir(self.run_dir / EVENTS_DIR).events if e.get("rank") is not None
        ]
        number = max([self.attempt] + seen) + 1
        self._align_trainer_counter(number)
        return number

    def _align_trainer_counter(self, number: int) -> None:
        from skyspot.trainer.rundir import ATTEMPTS, record_attempt
        from skyspot.trainer.files import read_json

        try:
            record = read_json(self.run_dir / ATTEMPTS)
            counted = int(record.get("attempt", 0)) if isinstance(record, dict) else 0
            if counted < number - 1:
                record_attempt(self.run_dir, number - 1)
        except (OSError, ValueError, TypeError):
            pass  # the trainer then counts from its event files

    def nodes_for(self, spot: bool) -> int:
        """Nodes of the next attempt: the trace's grant for this spot attempt; on-demand gets all."""
        grants = self.spec.spot_nodes
        if not spot or not grants:
            return self.spec.num_nodes
        return grants[min(self.spot_attempts, len(grants) - 1)]

    def where(self, spot: bool, num_nodes: int) -> dict:
        place = cloud_facts(self.spec.cloud).simulated
        zone = self.zone if spot else None
        return {
            "cloud": self.spec.cloud,
            "region": zone.region if zone else place.region,
            "zone": zone.zone if zone else place.zone,
            "instance_type": self.spec.instance_type,
            "spot": spot,
            "accelerators": self.spec.accelerators,
            "num_nodes": num_nodes,
            "simulated": True,
        }

    def node_dir(self, node_rank: int) -> Path:
        """Each simulated node has its own disk, as on a cloud: node 0 uses the run root (where its
        events and checkpoints are read back), node k the run root's nodes/node-k."""
        if node_rank == 0:
            return self.run_dir
        path = self.run_dir / "nodes" / f"node-{node_rank}"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    def node_env(self, node_rank: int, where: dict, metadata_env: dict, port: int) -> dict[str, str]:
        spec = self.spec
        bin_dir = str(Path(sys.executable).parent)
        cluster_info = {
            "cluster_name": f"{spec.name}-local",
            "cloud": cloud_facts(where["cloud"]).label,  # SkyPilot's spelling: AWS, GCP, Azure
            "region": where["region"],
            "zone": where["zone"],
            "num_nodes": where["num_nodes"],
            "instance_type": where["instance_type"],
            "use_spot": where["spot"],
            "simulated": True,
        }
        # Not the shell's recipe overrides (SKYSPOT_<SECTION>__<KEY>): the launch recorded the ones it
        # applied as the trainer's explicit overrides, and a resume keeps exactly those (issue 31, item 6).
        from skyspot.recipe import is_override_variable

        env = {k: v for k, v in os.environ.items() if not k.startswith("SKYPILOT_") and not is_override_variable(k)}
        if self.fresh is not None:
            env = self.fresh.env(env, spec.task_envs)
            # What SkyPilot passes a cloud node as a secret: the key that vouches for the run's wheelhouse.
            from skyspot.ledger import skyspot_home
            from skyspot.wheelhouse import KEY_ENV, run_key

            env[KEY_ENV] = run_key(skyspot_home(), spec.name)
        else:
            env.update(spec.task_envs)
            env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
            env["SKYSPOT_PYTHON"] = sys.executable  # no setup ran: `run` uses this environment's (task/render.py)
        env.update(metadata_env)
        if self.hosts is not None:  # gloo finds its interface by the hostname, which every namespace shares
            from skyspot.executors.local.netns import IFNAME

            env["GLOO_SOCKET_IFNAME"] = IFNAME
        env.update(
            {
                "SKYPILOT_NODE_RANK": str(node_rank),
                "SKYPILOT_NODE_IPS": "\n".join(
                    self.hosts.addrs[: where["num_nodes"]] if self.hosts else ["127.0.0.1"] * where["num_nodes"]
                ),
                "SKYPILOT_NUM_NODES": str(where["num_nodes"]),
                "SKYPILOT_NUM_GPUS_PER_NODE": "0",
                "SKYPILOT_TASK_ID": f"sky-managed-local_{spec.name}_1-0",
                "SKYPILOT_CLUSTER_INFO": json.dumps(cluster_info),
                "SKYSPOT_RUN_NAME": spec.name,
                "SKYSPOT_RUN_DIR": str(self.node_dir(node_rank)),
                "SKYSPOT_MASTER_PORT": str(port),
                "SKYSPOT_NOTICE_POLL_SECONDS": str(spec.notice_poll_seconds or self.timeline.poll_seconds),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def _pump(self, stream: IO[bytes], prefix: str) -> None:
        held: list[str] = []  # torchrun's failure report, held until we know whether it was a preemption
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self._note_cause(line)
            if held or _TORCHRUN_REPORT_START in line and f"exitcode: {RECOVER_EXIT_CODE})" in line:
                held.append(line)
                if not line.startswith("[skyspot.supervise]") and len(held) < 400:
                    continue
                if f"trainer exit {RECOVER_EXIT_CODE} " in line:
                    held = [
                        f"(torchrun's ChildFailedError report omitted: the trainer exited {RECOVER_EXIT_CODE}, "
                        "preempted after its emergency checkpoint, and asked to be recovered)\n",
                        line,
                    ]
                lines, held = held, []
            else:
                lines = [line]
            with self._log_lock:
                for one in lines:
                    self.log.write(prefix + one if prefix else one)
        if held:
            with self._log_lock:
                self.log.writelines(prefix + one if prefix else one for one in held)
        stream.close()

    def _note_cause(self, line: str) -> None:
        """Keep the last line that says why a node stopped, for when no exit record says it."""
        text = line.strip()
        if text.startswith(("[skyspot.supervise]", "[skyspot] exit")) or (
            _is_exception_line(text) and "ChildFailedError" not in text
        ):
            self.last_cause = text

    def _cause(self, nodes: int, since: float) -> Optional[str]:
        """Why the attempt's nodes stopped: the trainer's exit record on each node (its reason), else the
        last telling line of the log."""
        reasons = []
        for node_rank in range(nodes):
            try:
                record = json.loads((self.node_dir(node_rank) / EXIT_RECORD).read_text())
            except (OSError, ValueError):
                continue
            if (
                isinstance(record, dict)
                and isinstance(record.get("ts"), (int, float))
                and record["ts"] >= since
                and record.get("code") not in (0, None)
                and record.get("reason")
            ):
                reasons.append(str(record["reason"]))
        text = reasons[0] if reasons else self.last_cause
        if not text:
            return None
        text = " ".join(text.split())
        return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."

    # ------------------------------------------------------------------ one attempt
    def run_attempt(self, number: int, spot: bool, metadata) -> tuple[int, End, Optional[str]]:
        """One attempt from provisioning to its end: (exit code, outcome, cause); the outcome is a key of
        AFTER_ATTEMPT."""
        attempt = self._begin(number, spot, metadata)
        early = self._prepare(attempt) or self._setup(attempt)
        if early is not None:
            return self._close(attempt, early)
        self._start_nodes(attempt)
        while any(proc.poll() is None for proc in attempt.procs):
            self._watch(attempt, time.time())
            time.sleep(POLL_SECONDS)
        return self._close(attempt, self._ending(attempt))

    def _begin(self, number: int, spot: bool, metadata) -> Attempt:
        self.attempt = number
        self.last_cause = None
        nodes = self.nodes_for(spot)
        where = self.where(spot, nodes)
        if spot:
            self.spot_attempts += 1
        events = EventWriter(self.run_dir, self.spec.name, number, 0, None)
        ready = self.handover.take()
        events.emit("attempt_start", where=where, **({"provisioned_at": ready.at} if ready is not None else {}))
        attempt = Attempt(number, spot, nodes, where, events, metadata, started=time.time())
        metadata.reset()
        # What the node's own metadata read (trainer/instance.py) finds: the simulated instance.
        metadata.set_instance(
            where["instance_type"], spot=bool(where["spot"]), zone=where["zone"] or "", region=where["region"]
        )
        attempt.port = free_port()
        return attempt

    def _prepare(self, attempt: Attempt) -> Optional[Ending]:
        """The machine's one-time preparation before the first start (not on a fresh node: its setup does it)."""
        if self.fresh is not None or self.prepared:
            return None
        self.prepared = True
        if self.prepare_node(self.node_env(0, attempt.where, {}, attempt.port), tick=self._judging(attempt)):
            return None
        return Ending(1, End.CANCELLED, [])

    def _judging(self, attempt: Attempt) -> Callable[[], None]:
        """What runs every poll while the attempt's node is prepared: the deadline's judgement, if the run
        has one (a deadline that becomes unreachable meanwhile is said then, not after the preparation)."""
        planner = self.planner
        if planner is None:
            return lambda: None
        return lambda: planner.preparing(attempt.spot)

    def _setup(self, attempt: Attempt) -> Optional[Ending]:
        """A fresh node's setup on every node, as SkyPilot runs it on every newly provisioned VM."""
        failing = os.environ.get(FAIL_SETUP_ENV, "")
        if self.spec.cloud in failing.split(","):  # the tests' hook: this simulated cloud's setup fails
            self.say(f"setup on node 0 fails: {FAIL_SETUP_ENV}={failing} (a test hook)")
            return Ending(1, End.SETUP_FAILED, [1], f"the task's setup exited 1 on node 0 ({FAIL_SETUP_ENV})")
        if self.fresh is None:
            return None
        from skyspot.executors.local.fresh_node import run_setup

        self.say(f"setup on the fresh node ({self.fresh.venv})")
        for node_rank in range(attempt.nodes):
            code = run_setup(
                self.fresh,
                self.spec.setup_script,
                self.node_env(node_rank, attempt.where, {}, attempt.port),
                self.log,
                cwd=self.node_dir(node_rank),
                tick=self._judging(attempt),
            )
            if code != 0:
                cause = f"the task's setup exited {code} on node {node_rank}; `skyspot logs {self.spec.name}` has its output"
                return Ending(code, End.SETUP_FAILED, [code], cause)
        return None

    def _start_nodes(self, attempt: Attempt) -> None:
        spec = self.spec
        me = os.getpid()
        if self.hosts is not None:
            for node_rank in range(self.hosts.n):
                self.hosts.heal(node_rank)  # new machines: whatever cut the last attempt's links is gone
        for node_rank in range(attempt.nodes):
            on_host = self.hosts.exec_prefix(node_rank) if self.hosts is not None else []
            proc = subprocess.Popen(
                [*on_host, "bash", "-c", spec.run_script],
                cwd=self.node_dir(node_rank),
                env=self.node_env(node_rank, attempt.where, attempt.metadata.env_for(), attempt.port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: _die_with_controller(me),
            )
            attempt.procs.append(proc)
            prefix = f"(node-{node_rank}) " if spec.num_nodes > 1 else ""
            pump = threading.Thread(target=self._pump, args=(proc.stdout, prefix), daemon=True)
            pump.start()
            attempt.pumps.append(pump)
        self.ledger.record_attempt(spec.name, attempt.number, attempt.where, controller_pid=me, **self._progress())
        where = attempt.where
        self.say(
            f"attempt {attempt.number} running on simulated {where['cloud']} {where['region']} "
            f"{where['instance_type']} ({'spot' if attempt.spot else 'on-demand'}), {attempt.nodes} of "
            f"{spec.num_nodes} node(s)"
        )
        if self.planner is not None:
            self.planner.started(attempt.spot)

    def _watch(self, attempt: Attempt, now: float) -> None:
        """One poll: read the newest step, note a failed node, then the checks of ORDER that WATCH lists for
        the attempt's stage, in order, each against the stage the one before it left (a GCP notice and its
        SIGTERM land in one poll, as the cloud sends them together)."""
        codes = [proc.poll() for proc in attempt.procs]
        if attempt.steps_tail is None:
            steps_file = self._trainer_events_file(attempt.number)
            attempt.steps_tail = FileTail(steps_file) if steps_file is not None else None
        logged: list[tuple[str, int]] = []
        if attempt.steps_tail is not None:
            attempt.step = _latest_step(attempt.steps_tail, attempt.step, logged)
        # A rank fault fires on a step event just logged, not on the newest step ever seen: after a
        # restart in place the ranks redo steps, and the next fault is for a step in progress again.
        if attempt.first_step_at is None and any(kind == "step" for kind, _ in logged):
            attempt.first_step_at, attempt.first_step = now, attempt.step
        for kind, step in logged:
            if kind == "start":
                self.fault_armed = True
            elif self.fault_armed and self.pending_faults and step >= self.pending_faults[0]["step"]:
                self.fault_due = True
        if any(c not in (None, 0) for c in codes) and attempt.first_failure is None:
            attempt.first_failure = now  # a node died; the others must fail fast on their own
        if attempt.first_failure and now - attempt.first_failure > float(
            self.spec.task_envs.get("SKYSPOT_DIST_TIMEOUT_SECONDS", 600)
        ):
            self.say("a node failed and the others did not stop; killing them")
            _signal_all(attempt.procs, signal.SIGKILL)
        for check in ORDER:
            if check in WATCH[attempt.stage]:
                attempt.stage = check(self, attempt, now) or attempt.stage

    def _ending(self, attempt: Attempt) -> Ending:
        """How the attempt ended: its nodes' codes, and the outcome its last stage and code say."""
        for pump in attempt.pumps:
            pump.join(timeout=5)
        codes = [p.returncode for p in attempt.procs]
        code = (
            0
            if all(c == 0 for c in codes)
            else (RECOVER_EXIT_CODE if RECOVER_EXIT_CODE in codes else next(c for c in codes if c != 0))
        )
        if code == 0:
            outcome = End.COMPLETE
        else:
            # Stopped by nobody: 75 is a SIGTERM from elsewhere, the trainer saved and asked to be recovered.
            outcome = ENDED_BY[attempt.stage] or (End.PREEMPTED if code == RECOVER_EXIT_CODE else End.ERROR)
        cause = self._cause(attempt.nodes, attempt.started) if outcome in (End.ERROR, End.CANCELLED) else None
        return Ending(code, outcome, codes, cause)

    def _close(self, attempt: Attempt, ending: Ending) -> tuple[int, End, Optional[str]]:
        if attempt.spot:
            self.spot_seconds += time.time() - attempt.started
        if self.placer is not None:
            # What a preemption costs this run, for the next placement: the replacement's provisioning, then
            # this attempt's start to its first step (all of it when it never got there).
            ran = (attempt.first_step_at or time.time()) - attempt.started
            self.placer.restart_s = self.spec.provision_delay + ran
        attempt.events.emit(
            "attempt_end",
            code=ending.code,
            reason=ending.outcome,
            node_codes=ending.node_codes,
            **({"cause": ending.cause} if ending.cause else {}),
        )
        attempt.events.close()
        return ending.code, ending.outcome, ending.cause

    # ------------------------------------------------------------------ the node's one-time preparation
    def prepare_node(self, env: dict[str, str], tick: Callable[[], None] = lambda: None) -> bool:
        """Build DeepSpeed's CPU op before the first start when this machine has never built it, saying
        so (the task's setup does the same on a cloud node); `tick` every poll meanwhile. False if
        cancelled meanwhile."""
        if deepspeed_op_cached(env):
            return True
        self.activity(
            "preparing this machine once: DeepSpeed builds its CPU communication op on first use "
            "(about 1-2 minutes on 2 cores; later runs reuse it)"
        )
        started = time.time()
        proc = subprocess.Popen(
            ["bash", "-c", self.spec.prepare_script],
            cwd=self.run_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        pump = threading.Thread(target=self._pump, args=(proc.stdout, ""), daemon=True)
        pump.start()
        while proc.poll() is None:
            tick()
            if self.cancel.wait(POLL_SECONDS):
                _signal_all([proc], signal.SIGKILL)
                proc.wait()
                return False
        pump.join(timeout=5)
        self.activity(
            f"DeepSpeed's op ready after {time.time() - started:.0f}s; starting the trainer"
            if proc.returncode == 0
            else "the op build failed; the trainer builds it at its start"
        )
        return True

    def activity(self, text: Optional[str]) -> None:
        """What the run is doing when no event says it: in the log, and in the ledger for `launch` to show."""
        if text:
            self.say(text)
        self.ledger.set_activity(self.spec.name, text, **self._progress())

    def _trainer_events_file(self, attempt: int) -> Optional[Path]:
        """Rank 0's events file for this attempt (the trainer numbers its starts; take the newest
        numbered at least `attempt`, should the two counts ever differ)."""
        found = []
        for path in (self.run_dir / EVENTS_DIR).glob("attempt-*.node-0.rank-0.jsonl"):
            try:
                number = int(path.name.split(".")[0].split("-")[1])
            except (IndexError, ValueError):
                continue
            if number >= attempt:
                found.append((number, path))
        return max(found)[1] if found else None

    def _inject_fault(self, events: EventWriter, step: int, nodes: int) -> None:
        """The next rank fault, now that rank 0 logged its step: the ranks are in the step after it."""
        from skyspot.executors.local import rank_faults

        fault = self.pending_faults[0]
        done = rank_faults.inject(fault, self.spec.name, nodes, self.hosts)
        if done is None:
            return  # no live worker there now (restarting): the next poll tries again
        self.pending_faults.pop(0)
        self.fault_due = False
        self.fault_armed = fault["action"] == "cut"  # a cut ends the attempt: the next one starts armed
        events.emit(rank_faults.EVENT_TYPES[fault["action"]], step=step, at_step=fault["step"], **done)
        if fault["action"] == "cut":
            self.say(f"link cut at step {step}: node {done['node']} ({done['address']}) drops every packet")
            return
        self.say(
            f"{fault['action']} injected at step {step}: {done['signal']} to node {done['node']} local rank "
            f"{done['local_rank']} (pid {done['pid']})"
        )

    def _should_preempt(self, step: int, attempt_started: float, now: float) -> bool:
        spec = self.spec
        if self.pending_steps and step >= self.pending_steps[0]:
            self.pending_steps.pop(0)
            return True
        if self.pending_trace and now - self.launched_at >= self.pending_trace[0]:
            lost = self.pending_trace.pop(0)
            if self.zone is not None:
                self.placer.lost(self.zone, lost)
            return True
        return spec.preempt_every is not None and now - attempt_started >= spec.preempt_every

    def prices(self) -> Optional[tuple[float, float]]:
        """(spot, on-demand) $/h of the simulated instance, from the snapshot: spot where the next spot
        attempt would go (a zoned trace: the cheapest zone with capacity), on-demand in the simulated
        region; None when the snapshot lacks either."""
        from skyspot.pricing.prices import hourly_price

        region = cloud_facts(self.spec.cloud).simulated.region
        try:
            on_demand = hourly_price(
                self.spec.cloud, instance_type=self.spec.instance_type, region=region, spot=False, snapshot_only=True
            ).usd_per_hour
            if self.placer is not None:
                zone, _ = self.placer.choose(time.time() - self.launched_at)
                region = zone.region if zone is not None else region
            spot = hourly_price(
                self.spec.cloud, instance_type=self.spec.instance_type, region=region, spot=True, snapshot_only=True
            ).usd_per_hour
        except UsageError:
            return None
        return spot, on_demand

    def _progress(self) -> dict:
        """The info keys the controller keeps current in the ledger with every change it makes."""
        return {"preemptions": self.preemptions, "log": str(self.log_path)}

    def unused_trace_times(self) -> list[float]:
        """Trace preemptions never delivered because the run ended first (not those after spot capacity went)."""
        return list(self.pending_trace) if self.spec.trace_times and self.spot_available() else []

    # ------------------------------------------------------------------ the whole run
    def run(self) -> int:
        from skyspot.executors.local.metadata_server import MetadataServer

        spec = self.spec
        if spec.fresh_node:
            from skyspot.executors.local.fresh_node import make

            self.fresh = make(self.run_dir / "fresh-node", spec.file_mounts)
            self.say(
                f"run '{spec.name}' ({spec.recipe}) on a fresh node: a new virtual environment without "
                "skyspot; the task's setup installs it"
            )
        else:
            self.say(
                f"run '{spec.name}' ({spec.recipe}); setup skipped: this environment already has skyspot "
                "and its dependencies (what the task's setup installs)"
            )
        if spec.netns:
            from skyspot.executors.local.netns import Hosts

            self.hosts = Hosts(spec.num_nodes).__enter__()
            self.say(f"nodes on hosts of their own: {', '.join(self.hosts.addrs)} (network namespaces)")
        try:
            # A namespace cannot reach the root namespace's loopback: with --netns the metadata server
            # listens on the bridge's address.
            metadata = MetadataServer(host=self.hosts.bridge_addr if self.hosts else "127.0.0.1").start()
        except BaseException:
            if self.hosts is not None:
                self.hosts.close()
            raise
        try:
            while True:
                first = self.attempt == 0
                spot = self._provision(first)
                if spot is None:
                    return self._finish("CANCELLED", 1 if first else RECOVER_EXIT_CODE)
                number = self.next_attempt_number()
                code, outcome, cause = self.run_attempt(number, spot, metadata)
                self.say(f"attempt {number} ended: {outcome} (exit {code})" + (f": {cause}" if cause else ""))
                ended = AFTER_ATTEMPT[outcome](self, code, cause)
                if ended is not None:
                    return ended
        finally:
            metadata.stop()
            if self.hosts is not None:
                self.hosts.close()

    def _provision(self, first: bool) -> Optional[bool]:
        """The next attempt's capacity (True: spot), after the replacement's provisioning delay; None when
        the run was cancelled first."""
        spec = self.spec
        if self.cancel.is_set():
            return None
        if first:
            self.ledger.set_started(spec.name, os.getpid())
        else:
            self.ledger.set_recovering(spec.name, **self._progress())
            left = self.handover.left(time.time())
            if left is not None:  # the attempt ended on its own while its successor's node was provisioned
                self.say(
                    f"the {_capacity(left[0])} node provisioned while the last attempt trained is the replacement: "
                    f"ready in {left[1]:.0f}s"
                )
                if self.cancel.wait(left[1]):
                    return None
            if self.handover.prepared is not None:
                return self._made_ready(self.handover.prepared.spot)
            self.say(f"recovering: provisioning a replacement in {spec.provision_delay:.0f}s")
            if self.cancel.wait(spec.provision_delay):
                return None
        if self.planner is not None:
            return self.planner.choose()
        spot = self.spot_available()
        if not spot and self.preemptions and not first:
            self.say("spot capacity gone or fallback reached: this attempt runs on-demand")
        if self.placer is not None:
            spot = spot and self._place()
        return spot

    def _made_ready(self, spot: bool) -> bool:
        """The next attempt runs on the node the handover made ready (handover.py), without provisioning."""
        self.say(f"switching to the {_capacity(spot)} node made ready while the last attempt trained")
        # Trace times that passed while the run held no spot instance took nothing.
        elapsed = time.time() - self.launched_at
        self.pending_trace = [t for t in self.pending_trace if t > elapsed]
        if spot and self.placer is not None:
            spot = self._place()
        elif spot and not self.spot_available():
            self.say("spot went again while the last attempt stopped: this attempt runs on-demand")
            spot = False
        if not spot and self.handover.prepared is not None and self.handover.prepared.spot:
            self.handover.prepared = None  # no spot node after all: a new on-demand one, billed from its start
        return spot

    def _place(self) -> bool:
        """A zoned trace: choose the spot attempt's zone (zones.py); its losses from now on are the
        attempt's. False when no zone has spot capacity."""
        t = time.time() - self.launched_at
        self.zone, why = self.placer.choose(t)
        if self.zone is None:
            self.say(f"no spot: {why}")
            return False
        self.pending_trace = [loss for loss in self.zone.losses() if loss >= t]
        self.say(f"spot attempt placed in {self.zone.key} ({self.spec.placement}): {why}")
        return True

    def _finish(self, status: str, code: int, cause: Optional[str] = None) -> int:
        unused = self.unused_trace_times() if status == "SUCCEEDED" else []
        if unused:
            self.say(
                f"spot trace: {len(unused)} preemption(s) at {', '.join(f'{t:g}s' for t in unused)} after launch "
                f"never came: the run finished {time.time() - self.launched_at:.0f}s after launch"
            )
        self.ledger.set_finished(
            self.spec.name,
            status,
            exit_code=code,
            **self._progress(),
            cause=cause,
            activity=None,
            unused_trace_times=unused,
            finished_after_seconds=round(time.time() - self.launched_at, 1),
        )
        self.say(f"run {status}" + (f": {cause}" if cause else ""))
        self.log.close()
        return 0 if status == "SUCCEEDED" else (code or 1)


# ------------------------------------------------------------------ the attempt's transitions
# Each check looks at the attempt once a poll and returns the stage it moves it to (None: it stays).


def _inject_fault(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    if c.fault_due:
        c._inject_fault(a.events, a.step, a.nodes)
    return None


def _on_cancel(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    if not c.cancel.is_set():
        return None
    c.say("cancel requested: SIGTERM to the nodes (emergency checkpoint), then stop")
    _signal_all(a.procs, signal.SIGTERM)
    a.stop_at = now
    return Stage.CANCELLING


def _on_switch(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    """The deadline wants the other capacity: a node of it is made ready while this attempt trains
    (handover.py), then this attempt stops with an emergency checkpoint."""
    if c.planner is None:
        return None
    handover = c.handover
    if not handover.pending:
        want = c.planner.switch_due(now)
        if want is None:
            return None
        handover.begin(a, now, spot=want == SPOT, reason="deadline")
        c.say(f"deadline: provisioning a {want} node in {c.spec.provision_delay:.0f}s while this attempt trains")
    elif handover.to_spot and not c.spot_available():
        c.say("deadline: spot went again before the spot node was ready; staying on on-demand")
        handover.withdraw(a)
        return None
    if not handover.ready(a, now):
        return None
    c.say(f"deadline: the new node is ready at step {a.step}: this attempt checkpoints and stops")
    _signal_all(a.procs, signal.SIGTERM)
    a.stop_at = now
    return Stage.SWITCHING


def _capacity(spot: bool) -> str:
    return "spot" if spot else "on-demand"


def _on_spot_back(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    """On-demand while spot is back: a spot node made ready meanwhile, then this attempt stops with an
    emergency checkpoint (return_to_spot.py, handover.py)."""
    if c.back is None or a.spot or not c.back.poll(a, now):
        return None
    _signal_all(a.procs, signal.SIGTERM)
    a.stop_at = now
    return Stage.SWITCHING


def _on_preempt(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    if not a.spot or not c._should_preempt(a.step, a.started, now):
        return None
    timeline = c.timeline
    a.notice_at = now
    a.metadata.announce_preemption(now + timeline.window)
    a.events.emit(
        "preempt_notice_sent",
        deadline=now + timeline.window,
        step=a.step,
        cloud=timeline.cloud,
        sigterm_at=None if timeline.sigterm_after is None else now + timeline.sigterm_after,
        kill_at=now + timeline.kill_after,
    )
    c.say(f"preemption notice at step {a.step}: {_describe(timeline)}")
    return Stage.NOTICED


def _on_cloud_sigterm(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    after = c.timeline.sigterm_after
    if after is None or a.notice_at is None or now < a.notice_at + after:
        return None
    _signal_all(a.procs, signal.SIGTERM)
    a.events.emit("preempt_sigterm")
    c.say("preemption: SIGTERM to the node's processes")
    return Stage.PREEMPTING


def _on_kill(c: Controller, a: Attempt, now: float) -> Optional[Stage]:
    """SIGKILL once, when the noticed VM is gone or the controller's own SIGTERM's grace is over."""
    gone = a.notice_at is not None and now >= a.notice_at + c.timeline.kill_after
    if a.killed_at is not None or not (gone or (a.stop_at is not None and now >= a.stop_at + c.stop_grace)):
        return None
    _signal_all(a.procs, signal.SIGKILL)
    a.killed_at = now
    a.events.emit("preempt_sigkill")
    c.say("the simulated VM is gone: SIGKILL" if gone else "grace period over: SIGKILL")
    return None


Check = Callable[[Controller, Attempt, float], Optional[Stage]]
ORDER: tuple[Check, ...] = (
    _inject_fault,
    _on_cancel,
    _on_switch,
    _on_spot_back,
    _on_preempt,
    _on_cloud_sigterm,
    _on_kill,
)
"""The order of the checks within one poll."""
WATCH: dict[Stage, frozenset[Check]] = {
    Stage.RUNNING: frozenset({_inject_fault, _on_cancel, _on_switch, _on_spot_back, _on_preempt}),
    Stage.NOTICED: frozenset({_inject_fault, _on_cancel, _on_cloud_sigterm, _on_kill}),
    Stage.PREEMPTING: frozenset({_inject_fault, _on_kill}),
    Stage.CANCELLING: frozenset({_on_kill}),  # no rank fault into a run being stopped
    Stage.SWITCHING: frozenset({_inject_fault, _on_kill}),
}
"""What is watched in each stage."""


# ------------------------------------------------------------------ after an attempt
# Each returns the run's exit code when the run ends there, None to start the next attempt.


def _succeeded(c: Controller, code: int, cause: Optional[str]) -> Optional[int]:
    return c._finish("SUCCEEDED", 0)


def _cancelled(c: Controller, code: int, cause: Optional[str]) -> Optional[int]:
    return c._finish("CANCELLED", code)


def _setup_failed(c: Controller, code: int, cause: Optional[str]) -> Optional[int]:
    return c._finish("FAILED_SETUP", code, cause)


def _preempted(c: Controller, code: int, cause: Optional[str]) -> Optional[int]:
    c.preemptions += 1
    return None


def _switched(c: Controller, code: int, cause: Optional[str]) -> Optional[int]:
    return None


def _errored(c: Controller, code: int, cause: Optional[str]) -> Optional[int]:
    """Retried up to max_restarts_on_errors, unless a restart cannot fix it (NOT_RETRIED)."""
    if code in NOT_RETRIED:
        c.say(f"not restarted: exit {code} is {NOT_RETRIED[code]}, which a restart cannot fix")
        return c._finish("FAILED", code, cause)
    c.errors += 1
    if c.errors > c.spec.max_restarts_on_errors:
        return c._finish("FAILED", code, cause)
    c.say(f"restart {c.errors}/{c.spec.max_restarts_on_errors} after an error")
    return None


AFTER_ATTEMPT: dict[End, Callable[[Controller, int, Optional[str]], Optional[int]]] = {
    End.COMPLETE: _succeeded,
    End.CANCELLED: _cancelled,
    End.SETUP_FAILED: _setup_failed,
    End.PREEMPTED: _preempted,
    End.SWITCHED: _switched,
    End.ERROR: _errored,
}
"""An attempt's outcome -> what the run does next."""


def _describe(timeline: Timeline) -> str:
    """The rest of a preemption on `timeline`, for the log."""
    w = timeline.window
    if cloud_facts(timeline.cloud).sigterm == "at_deadline":
        return f"SIGTERM in {w:g}s (the notice's time), the VM gone {timeline.kill_after - w:g}s later"
    if cloud_facts(timeline.cloud).sigterm == "with_notice":
        return f"SIGTERM now (ACPI soft-off with the notice), the VM gone in {w:g}s"
    return f"a Preempt event, the VM gone at its NotBefore in {w:g}s (no SIGTERM)"


# torchrun's own line before its ChildFailedError report (torch/distributed/elastic/multiprocessing/api.py).
_TORCHRUN_REPORT_START = "failed (exitcode: "


def _is_exception_line(text: str) -> bool:
    """`SomeError: message`, the last line of a Python traceback."""
    head, sep, _ = text.partition(": ")
    return bool(sep) and head.replace(".", "").replace("_", "").isalnum() and head.endswith(("Error", "Exception"))


def deepspeed_op_cached(env: Optional[dict] = None) -> bool:
    """Whether torch's extension cache holds a build of DeepSpeed's CPU communication op made from this
    DeepSpeed's sources (a cheap look at the directory torch.utils.cpp_extension builds into; a build
    from another install, say another checkout's venv, is rebuilt by torch at the trainer's start,
    so it does not count; a miss only costs one `prepare`)."""
    env = os.environ if env is None else env
    root = env.get("TORCH_EXTENSIONS_DIR")
    if root:
        builds = list(Path(root).glob(f"{SHM_OP}*/{SHM_OP}*.so"))
    else:
        cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
        builds = list((cache / "torch_extensions").glob(f"*/{SHM_OP}*/{SHM_OP}*.so"))
    sources = _deepspeed_dir()
    return any(sources is None or sources in _read_text(so.parent / "build.ninja") for so in builds)


def _deepspeed_dir() -> Optional[str]:
    """Where this environment's DeepSpeed lives, without importing it (seconds of start-up)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return str(Path(locations[0]).resolve()) if locations else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _latest_step(tail: FileTail, step: int, logged: Optional[list[tuple[str, int]]] = None) -> int:
    """The newest step in rank 0's events file, reading only what was appended since the last call;
    `logged` gets, in order, ("step", STEP) for each step event appended since and ("start", 0) for each
    start of a generation of workers."""
    for line in tail.read().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("type") == "start" and logged is not None:
            logged.append(("start", 0))
        if event.get("type") in ("step", "resume") and isinstance(event.get("step"), int):
            step = max(step, event["step"])
            if logged is not None and event["type"] == "step":
                logged.append(("step", event["step"]))
    return step


def _die_with_controller(controller: int) -> None:
    """In a node's shell, before exec: a SIGTERM when this controller dies, however it dies (kill -9, out of
    memory), so no trainer trains on unseen. The run script execs the supervisor, which keeps the setting
    (it survives exec), forwards the SIGTERM to torchrun's workers as a preemption's would be (an emergency
    checkpoint, then exit), and takes torchrun down with it if it is killed itself (trainer/supervise.py).
    A controller that died before the prctl sends nothing: then the node does not start."""
    if set_parent_death_signal(signal.SIGTERM) and os.getppid() != controller:
        os._exit(1)


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m skyspot.executors.local.controller RUN_NAME", file=sys.stderr)
        return EXIT_USAGE
    with Ledger() as ledger:
        run = ledger.get(argv[0])
        run_dir = Path(run.run_dir)
        # Held until this process ends, however it ends: what `cancel` and `resume` know it by.
        lock = controller_lock.adopt()
        if lock is None:  # started by hand, not by the launcher
            lock = controller_lock.acquire(run_dir)
            controller_lock.record(lock, os.getpid())
        spec = Spec(**json.loads((run_dir / "local.json").read_text()))
        controller = Controller(run_dir, spec, ledger)

        def request_cancel(signum, frame):
            controller.cancel.set()

        signal.signal(signal.SIGTERM, request_cancel)
        signal.signal(signal.SIGINT, request_cancel)
        try:
            return controller.run()
        except BaseException as error:  # record the failure; the ledger must never say RUNNING forever
            ledger.set_failed(spec.name)
            controller.say(f"controller failed: {type(error).__name__}: {error}")
            raise


if __name__ == "__main__":
    sys.exit(main())
