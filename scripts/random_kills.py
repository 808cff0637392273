"""Random faults against `tiny` (issue 34's fault soak): every resume loads a valid checkpoint, nothing
committed is lost or rolled back, and the final parameters equal an uninterrupted run's, bitwise.

    python scripts/random_kills.py --seed 34 --faults 11 --kinds all --steps 24 --store   # one of each kind

--faults N (alias --kills) faults, each kind chosen by the seed from --kinds (`all` or a comma list;
default the four kill kinds below). Beyond the kills: notice (SIGTERM to every process of the tree, the
supervisor's grace set to a seeded cloud's notice window: emergency checkpoint of the last step, exit 75,
nothing redone), wipe (a step kill that also wipes the local disk), crash / hang (one rank SIGKILLed /
SIGSTOPped under torchrun --max-restarts and a c10d rendezvous; torchrun or the watchdog restarts the
ranks in place from the local tier; then a notice ends the start), stale (an older attempt on a disk of
its own, held at step_end before its first commit while this start takes the store's fence: released,
it must exit 76 and commit nothing), emergency (a notice at a held step_end, then a SIGKILL while that
step's writer is held at a random point), resume (a SIGKILL after the resume event, before the first
step), outage (moto's S3 server on loopback is the store whenever `outage` is among the kinds: it is
stopped for 2 to 8 s mid-run, as in tests/trainer/test_store_e2e.py; training must go on meanwhile and the
uploads catch up once it is back; then a notice ends the start). The network kinds, cut / partition /
freeze / lossy (host K's link silent, cut off from the other host, every process of it SIGSTOPped, or 2 to
15 % of its packets lost), run in a lane of their own: two nodes, one rank each, on network namespaces of
their own (root; see "the network lane" below). `--lanes N` runs N lanes of each side by side. A table per
kind (count, resumes from the local tier and from the store, steps redone, recovery seconds: the first
step after the fault minus the fault; for an outage, the store's return to the uploads caught up) is
printed before the one-line summary.
`--stop-after SECONDS` sizes a soak by the time at hand: no start begun after it is given a fault (one
begun before it may still land its fault after it), and every lane's run then finishes uninterrupted and
is compared bitwise as ever (the summary says how many of the planned faults were made).

    python scripts/random_kills.py --seed 50 --kills 50 --steps 60 --store        # kills only, long (16 min here)
    python scripts/random_kills.py --seed 7 --kills 12 --steps 24 --store         # kills only, medium (5 min)

The seed is printed first; the figures come last, as one line (and as JSON with --json FILE).
Exit 0 when every invariant held, 1 otherwise. tests/reliability/test_random_kills.py runs a
bounded form in CI; docs/reliability.md has the figures of the latest long run.

Every start runs as on a node (`python -m skyspot.trainer.supervise --run-dir D -- torchrun
--nproc_per_node 2 -m skyspot.trainer tiny --run-dir D ...`), with checkpoint.every_steps=1 by
default so that a background write is in flight at most moments. Kill moments cycle through
four kinds, in a seeded random order:

    startup   a random moment before the first step, or at it at the latest (imports, rendezvous,
              resume scan, model build)
    step      a random moment within a random step
    write     while a checkpoint writer is held at a random point (SKYSPOT_FAULT=<point>@<step>/<rank>:hold):
              before any file, mid-file, before the manifest, before the marker, just after the marker
    worker    one rank only, at a random moment within a random step (torchrun tears down the other)

The first three kill either every process of the tree at once (a VM taken away) or only the
supervisor's process group (torchrun and the workers must then die with it: PR_SET_PDEATHSIG).
With --store, checkpoints are also uploaded to a local-directory store, so kills land during
uploads too (each file streams to the store while it is written). With --wipe (which implies
--store) every kill also wipes the node's local disk, the way a spot VM's instance storage goes
with it: the run directory is deleted (its event files kept aside for the checks), so every
resume comes from the store alone.

Checked after every kill (a full sha256 scan of checkpoints/, and the store's markers):
    no checkpoint directory is ever corrupt: a kill leaves a complete checkpoint or one without a marker;
    the newest valid checkpoint never goes back, and a committed one disappears only when retention
    removed it because `keep` newer ones exist: no committed checkpoint is lost;
    no killed process survives into the next start;
    every durable checkpoint in the store (all markers there) has every file its manifest lists, with
    that size and sha256, and the newest durable one never goes back.
Checked per start: its `resume` event names the newest valid checkpoint seen before it started
(newest of the local ones and the store's durable ones); a start never trains from step 0 while a
valid checkpoint exists. At the end: exit 0, every logged step's loss and lr equal the
reference's, and final/model.safetensors equals the reference's tensor for tensor (torch.equal).
"Steps recomputed" is the work a kill cost: the last step it reached minus the newest valid checkpoint
it left (where the next start must resume).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from skyspot.clouds import NOTICE_WINDOWS_S  # noqa: E402
from skyspot.trainer import manifest as mf  # noqa: E402
from tests.trainer.launch import free_port, host_node, trainer_env  # noqa: E402  the tests' node launcher helpers

BIN = Path(sys.executable).parent
KINDS = ("startup", "step", "write", "worker")
"""The kill kinds (the default set, as before the fault soak)."""
NEW_KINDS = ("notice", "wipe", "crash", "hang", "outage", "stale", "emergency", "resume")
NET_KINDS = ("cut", "partition", "freeze", "lossy")
"""Kinds of the network lane (two nodes on hosts of their own: root and network namespaces)."""
ALL_KINDS = KINDS + NEW_KINDS + NET_KINDS
STEP_KINDS = ("step", "worker", "wipe", "notice", "crash", "hang", "outage", "stale", "emergency")
"""Kinds placed at a step: they need a step left to train after the newest checkpoint."""
IN_PLACE = ("crash", "hang")
STORE_KINDS = ("wipe", "stale", "outage")
ROOMY = ("crash", "hang", "outage", "stale")
"""Kinds that train on after the fault (then a notice ends the start): they need ROOM steps left."""
ROOM = 5
EXTRA_ENV: dict[str, str] = {}
"""Set for every start (with an S3 store: quick retries, so uploads catch up soon after an outage)."""
CLOUDS = ("aws", "gcp", "azure")
HANG_FLOOR_S = 4.0  # the watchdog's bound for hang starts (a tiny step is well under it)
WRITE_POINTS = ("write_begin", "mid_file", "before_manifest", "before_marker", "after_marker")
LEADER_ONLY = {"before_manifest", "before_marker", "after_marker"}  # only the node leader commits
START_TIMEOUT_S = 600.0  # a start without a new step this long is stuck
OUTAGE_STEP_S = 120.0  # a store outage lasts until the run has made a step without the store, at most this
GRACE_S = 15  # torchrun's wait for a surviving worker after a kill (supervise --grace)
MAX_MISSES = 5


@dataclass
class Kill:
    number: int
    kind: str
    target: str  # "tree", "group" or "rank-<R>"
    attempt: Optional[int]
    resumed_from: Optional[int]
    """The newest valid checkpoint before this start (what it had to resume from)."""
    planned: str
    phase: str = ""
    """Where the kill landed: "startup" (no step yet), "step <N>", or the fault point that held."""
    reached: int = 0
    """The last step any event shows this start reached."""
    lost_steps: int = 0
    seconds: float = 0.0
    at: float = 0.0
    """Wall-clock time of the fault (time.time(), as event timestamps)."""
    recovery_seconds: Optional[float] = None
    """The first step after the fault (of the next attempt, or of the restart in place) minus `at`."""
    resume_source: Optional[str] = None
    """Where the recovery resumed from: "local" or "store" (None: from scratch)."""
    code: Optional[int] = None
    noticed_seconds: Optional[float] = None
    """Network faults: the fault to the other node's exit (its collective's timeout)."""


@dataclass
class Result:
    seed: int
    kills_planned: int
    steps: int
    every_steps: int
    keep: int
    store: bool
    kills: list[Kill] = field(default_factory=list)
    starts: int = 0
    resumes: int = 0
    resumes_from_store: int = 0
    lost_steps: int = 0
    lost_committed: int = 0
    corrupt_seen: int = 0
    incomplete_seen: int = 0
    orphans: int = 0
    durable_uploads: int = 0
    """Checkpoints the uploader made durable in the store (with --store)."""
    wipe: bool = False
    wipes: int = 0
    durable_verified: int = 0
    """Durable checkpoints whose files were checked against their manifests after a kill (with --wipe)."""
    durable_corrupt: int = 0
    rolled_back: int = 0
    """Times the newest durable checkpoint in the store went back."""
    stale_refused: int = 0
    """Older attempts that exited STALE (76) while a newer one held the store."""
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    violations: list[str] = field(default_factory=list)
    steps_compared: int = 0
    final_equal: bool = False
    final_code: Optional[int] = None
    seconds: float = 0.0
    work: str = ""
    lanes: list[str] = field(default_factory=list)
    """With lanes: each lane's seed, faults, end and wall time."""
    stopped_early: bool = False
    """--stop-after came before the last planned fault: no later start got one; the run finished and was compared."""
    commit: str = ""
    """The source the soak ran (`git rev-parse HEAD`, "+dirty" with uncommitted changes to tracked files)."""
    reference_sha256: str = ""
    """sha256 of the reference run's final/model.safetensors: parts of one plan must share it."""
    plan_faults: int = 0
    """The whole plan's faults (--faults), of which a part (--part) runs its lanes' share."""
    lanes_per_side: int = 1
    part: str = ""
    """"K/N" for one part of a plan run in parts; "" for a whole plan (or parts merged: see `parts`)."""
    parts: int = 0
    """Parts merged into this result (--merge), run one after another."""
    reference_variants: int = 0
    """Merged parts whose machines' reference runs ended with different parameters (0 or 1: all equal)."""

    @property
    def ok(self) -> bool:
        return not self.violations and self.final_equal and self.final_code == 0

    def per_kind(self) -> dict[str, dict]:
        """Per fault kind: count, resumes from the local tier and from the store, steps redone, recovery seconds."""
        out = {}
        for kind in ALL_KINDS:
            faults = [x for x in self.kills if x.kind == kind]
            if not faults:
                continue
            recovered = [x.recovery_seconds for x in faults if x.recovery_seconds is not None]
            out[kind] = {
                "count": len(faults),
                "resumes_local": sum(x.resume_source == "local" for x in faults),
                "resumes_store": sum(x.resume_source == "store" for x in faults),
                "steps_redone": sum(x.lost_steps for x in faults),
                "recovery_s_median": round(sorted(recovered)[len(recovered) // 2], 1) if recovered else None,
                "recovery_s_max": round(max(recovered), 1) if recovered else None,
            }
            noticed = [x.noticed_seconds for x in faults if x.noticed_seconds is not None]
            if noticed:  # network faults: how long the other node took to stop (its collective's timeout)
                out[kind]["noticed_s_min"], out[kind]["noticed_s_max"] = min(noticed), max(noticed)
        return out

    def table(self) -> str:
        lines = [f"{'kind':10} {'count':>5} {'local':>5} {'store':>5} {'redone':>6} {'recovery s (median/max)':>24}"]
        for kind, row in self.per_kind().items():
            rec = f"{row['recovery_s_median']}/{row['recovery_s_max']}"
            noticed = (
                f"  peer stopped {row['noticed_s_min']}-{row['noticed_s_max']} s on" if "noticed_s_max" in row else ""
            )
            lines.append(
                f"{kind:10} {row['count']:5} {row['resumes_local']:5} {row['resumes_store']:5} "
                f"{row['steps_redone']:6} {rec:>24}{noticed}"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        kinds = {k: n for k in ALL_KINDS if (n := sum(1 for x in self.kills if x.kind == k))}
        uploads = f"{self.durable_uploads} uploads made durable, " if self.store else ""
        if self.wipe:
            uploads += (
                f"{self.wipes} local disks wiped, {self.durable_verified} durable checkpoint checks "
                f"({self.durable_corrupt} corrupt), "
            )
        return (
            f"seed {self.seed}: {len(self.kills)} faults ({', '.join(f'{v} {k}' for k, v in kinds.items())}), "
            f"{self.starts} starts, {self.resumes} resumes ({self.resumes_from_store} from the store), "
            f"{self.lost_steps} steps recomputed, {self.lost_committed} committed checkpoints lost, "
            f"{self.rolled_back} rolled back, {self.stale_refused} stale attempts refused, "
            f"{self.corrupt_seen} corrupt, {self.incomplete_seen} cut writes skipped, {self.orphans} orphans, "
            f"{uploads}{self.steps_compared} step losses compared, final params "
            f"{'equal' if self.final_equal else 'DIFFERENT'} bitwise, {len(self.violations)} violations, "
            f"{self.seconds:.0f} s"
            + (f" ({len(self.lanes)} lanes side by side)" if len(self.lanes) > 1 and not self.parts else "")
            + (
                f" ({self.parts} parts one after another, {len(self.lanes)} lanes in all, at {self.commit or '?'})"
                if self.parts
                else ""
            )
            + (
                f"; part {self.part} of a {self.plan_faults}-fault plan ({self.lanes_per_side} lanes a side)"
                if self.part
                else ""
            )
            + (
                f"; the parts' reference runs ended with {self.reference_variants} different parameter sets "
                "(machines whose CPUs round differently: each part's lanes were compared with their own machine's)"
                if self.reference_variants > 1
                else ""
            )
            + (
                f"; the time limit stopped the faults at {len(self.kills)} of {self.kills_planned} planned"
                if self.stopped_early
                else ""
            )
        )


# --------------------------------------------------------------------------- launching


def launch(
    run_dir: Path,
    overrides: list[str],
    log: Path,
    *,
    store: Optional[str] = None,
    grace: float = GRACE_S,
    in_place: bool = False,
    **env: str,
) -> subprocess.Popen:
    """One node: `supervise -- torchrun --nproc_per_node 2 -m skyspot.trainer tiny`, in its own session.
    `in_place`: as the rendered task runs it (c10d rendezvous, --max-restarts), with a hang bound of
    HANG_FLOOR_S, so a crashed or hung rank is restarted in place."""
    port = str(free_port())
    rendezvous = (
        ["--max-restarts", "3", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
        if in_place
        else ["--master_addr", "127.0.0.1", "--master_port", port]
    )
    watchdog = ["--hang-floor", str(HANG_FLOOR_S), "--first-step-bound", "300"] if in_place else []
    command = [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(run_dir),
        "--grace",
        str(grace),
        *watchdog,
        "--",
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        *rendezvous,
        "-m",
        "skyspot.trainer",
        "tiny",
        "--run-dir",
        str(run_dir),
        "--run-name",
        run_dir.name,
        *([f"storage.store={store}"] if store else []),
        *overrides,
        *(["resilience.restart_backoff_seconds=1"] if in_place else []),
    ]
    env = {**EXTRA_ENV, **env}
    if in_place:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the rendered task sets it
    run_dir.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, cwd=REPO, env=trainer_env(**env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def overrides_for(steps: int, every: int, keep: int) -> list[str]:
    return [
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"checkpoint.keep={keep}",
        f"train.log_every={steps}",
    ]


# --------------------------------------------------------------------------- reading a run


# With --wipe, the event files of a wiped run directory are kept here (keyed by the run directory)
# before the wipe, as a VM's logs outlive it elsewhere; every reader below reads both.
ARCHIVES: dict[Path, Path] = {}


_PARSED: dict[Path, tuple[int, int, list[dict]]] = {}
"""Per event file: (inode, bytes parsed, its events). The harness polls every 50 ms and a long soak leaves
thousands of event files: each poll parses only what was appended since (a newer inode, or a file that
shrank, is parsed again from its start)."""


def _file_events(path: Path) -> list[dict]:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            inode, offset, events = _PARSED.get(path, (st.st_ino, 0, []))
            if inode != st.st_ino or st.st_size < offset:
                offset, events = 0, []
            f.seek(offset)
            data = f.read()
    except OSError:
        return _PARSED.get(path, (0, 0, []))[2]
    end = data.rfind(b"\n") + 1  # a line being written (or torn by a kill) waits for its newline
    events = list(events)
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "type" in event:
            events.append(event)
    _PARSED[path] = (st.st_ino, offset + end, events)
    return events


def read_events(run_dir: Path, pattern: str = "*.jsonl") -> list[dict]:
    """Every readable event line (a kill may tear the last line of a file: skipped)."""
    dirs = [run_dir / "events"] + ([ARCHIVES[run_dir]] if run_dir in ARCHIVES else [])
    out = [e for path in sorted(p for d in dirs for p in d.glob(pattern)) for e in _file_events(path)]
    return sorted(out, key=lambda e: e.get("ts", 0))


def attempts_seen(run_dir: Path) -> set[int]:
    found = set()
    dirs = [run_dir / "events"] + ([ARCHIVES[run_dir]] if run_dir in ARCHIVES else [])
    for path in (p for d in dirs for p in d.glob("attempt-*.node-*.rank-*.jsonl")):
        try:
            found.add(int(path.name.split(".")[0].split("-")[1]))
        except (IndexError, ValueError):
            pass
    return found


def rank0_steps(run_dir: Path, attempts: set[int]) -> tuple[int, list[float]]:
    """The newest step rank 0 logged in these attempts, and the step times."""
    newest, times = 0, []
    for attempt in attempts:
        for event in read_events(run_dir, f"attempt-{attempt}.node-0.rank-0.jsonl"):
            if event["type"] == "step":
                newest = max(newest, event["step"])
                times.append(event.get("step_seconds") or 0.0)
    return newest, times


def valid_steps(run_dir: Path, result: Result, where: str) -> list[int]:
    """A full-checksum scan: valid steps, newest first. Counts what a kill left behind."""
    valid = []
    for verdict in mf.scan(run_dir / "checkpoints"):
        if verdict.state == "valid":
            valid.append(verdict.step)
        elif verdict.state == "corrupt":
            result.corrupt_seen += 1
            result.violations.append(f"{where}: {verdict} (a kill must never leave a corrupt checkpoint)")
    return valid


def incomplete_dirs(run_dir: Path) -> set[str]:
    return {v.path.name for v in mf.scan(run_dir / "checkpoints", verify_checksums=False) if v.state == "incomplete"}


_STORES: dict[str, object] = {}


def _store(uri: str):
    from skyspot.storage import open_store

    if uri not in _STORES:
        _STORES[uri] = open_store(uri)
    return _STORES[uri]


def durable_steps(store: Optional[str], run_name: str) -> list[int]:
    """Steps the store holds durable (every node's marker there), newest first."""
    if store is None:
        return []
    from skyspot.trainer.remote import remote_checkpoints

    return sorted(remote_checkpoints(_store(store), run_name), reverse=True)  # type: ignore[arg-type]


def verify_durable(store: str, run_name: str) -> tuple[int, list[str]]:
    """Check every durable checkpoint's files in the store against its manifest: (checked, problems)."""
    import hashlib

    bucket = _store(store)
    problems, checked = [], 0
    for step in durable_steps(store, run_name):
        prefix = f"{run_name}/checkpoints/step_{step}"
        checked += 1
        raw = bucket.get_bytes(f"{prefix}/manifest.node-0.json")  # type: ignore[attr-defined]
        try:
            manifest = json.loads(raw)
            marker = json.loads(bucket.get_bytes(f"{prefix}/COMMITTED.node-0-of-1"))  # type: ignore[attr-defined]
        except (TypeError, ValueError) as err:
            problems.append(f"durable step_{step}: manifest or marker unreadable ({err})")
            continue
        if hashlib.sha256(raw).hexdigest() != marker.get("manifest_sha256"):
            problems.append(f"durable step_{step}: the manifest does not match its marker")
        for rel, meta in manifest.get("files", {}).items():
            data = bucket.get_bytes(f"{prefix}/{rel}")  # type: ignore[attr-defined]
            if data is None:
                problems.append(f"durable step_{step}: {rel} is missing")
            elif len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                problems.append(f"durable step_{step}: {rel} is corrupt")
    return checked, problems


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def environ_rank(p: psutil.Process) -> Optional[int]:
    try:
        value = p.environ().get("RANK")
        return int(value) if value is not None and "LOCAL_RANK" in p.environ() else None
    except (psutil.Error, ValueError):
        return None


# --------------------------------------------------------------------------- the harness


class Harness:
    def __init__(
        self,
        *,
        seed: int,
        kills: int,
        steps: int,
        every: int,
        keep: int,
        work: Path,
        reference: Optional[Path],
        store: bool,
        say=None,
        wipe: bool = False,
        kinds: tuple[str, ...] = KINDS,
        stop_at: Optional[float] = None,
    ):
        self.rng = random.Random(seed)
        self.stop_at = stop_at  # time.time() after which no fault is planned: the run finishes, then is compared
        store = store or wipe or any(k in STORE_KINDS for k in kinds)
        self.wipe = wipe
        self.result = Result(seed, kills, steps, every, keep, store, work=str(work), wipe=wipe, kinds=list(kinds))
        self.steps, self.every, self.keep = steps, every, keep
        self.work = work
        self.run_dir = work / "kills"
        self.s3 = None
        if "outage" in kinds:  # an outage needs a store whose errors are transient: moto's S3 on loopback
            self.s3 = _s3_server()
            self.store: Optional[str] = self.s3.bucket("soak")
        else:
            self.store = str(work / "store") if store else None
        self.reference = reference
        self.overrides = overrides_for(steps, every, keep)
        self.startup_estimates: list[float] = []
        self.step_estimate = 0.5
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wiping = False
        order: list[str] = []
        while len(order) < kills:
            block = list(kinds)
            self.rng.shuffle(block)
            order += block
        order = order[:kills]
        tail = order[-len(kinds) :]  # the last block: the kinds that need steps left go first
        self.order = order[: -len(tail)] + [k for k in tail if k in ROOMY] + [k for k in tail if k not in ROOMY]

    # ------------------------------------------------------------------ planning a kill
    def _target_step(self, newest: int, remaining: int, last: int) -> int:
        """A step after `newest`, spread so the remaining kills fit before `last`."""
        span = max(1, math.ceil(2 * (last - newest) / (remaining + 1)))
        return self.rng.randint(newest + 1, min(last, newest + span))

    def _plan(self, kind: str, newest: int, remaining: int) -> tuple[str, dict]:
        """(kind, plan) for a start whose newest valid checkpoint is `newest` (0: none)."""
        n = self.steps
        if kind == "stale" and not durable_steps(self.store, self.run_dir.name):
            kind = "step"  # the older attempt resumes from the store: it needs a durable checkpoint
        if kind == "resume" and not newest:
            kind = "startup"  # nothing to resume from yet
        if kind in ROOMY and newest >= n - ROOM - 1:
            kind = "step"  # too near the end to train on after the fault
        if kind == "notice" and newest >= n - 2:
            kind = "write" if newest < n else "startup"
        if kind in STEP_KINDS and newest >= n - 1:
            kind = "write" if newest < n else "startup"
        if kind == "write" and newest >= n:
            kind = "startup"
        if kind in ("startup", "resume"):
            return kind, {"target": self.rng.choice(("tree", "group"))}
        if kind == "stale":
            return kind, {"step": newest + 1, "target": "tree"}  # the older attempt holds before it commits
        if kind in ("notice", "crash", "hang", "emergency", "outage"):
            last = n - ROOM if kind in ROOMY else n - 2 if kind == "notice" else n - 1  # notice: a step to recover
            plan = {"step": self._target_step(newest, remaining, last), "cloud": self.rng.choice(CLOUDS)}
            if kind in IN_PLACE:
                plan["target"] = f"rank-{self.rng.randint(0, 1)}"
            if kind == "emergency":
                plan["point"] = self.rng.choice(WRITE_POINTS)
                plan["rank"] = 0 if plan["point"] in LEADER_ONLY else self.rng.randint(0, 1)
                plan["target"] = self.rng.choice(("tree", "group"))
            return kind, plan
        if kind in ("step", "worker", "wipe"):
            plan = {
                "step": self._target_step(newest, remaining, n - 1),
                "target": f"rank-{self.rng.randint(0, 1)}" if kind == "worker" else self.rng.choice(("tree", "group")),
            }
            return kind, plan
        candidates = [s for s in range(newest + 1, n + 1) if s % self.every == 0 or s == n]
        span = max(1, math.ceil(2 * len(candidates) / (remaining + 1)))
        step = self.rng.choice(candidates[:span])
        point = self.rng.choice(WRITE_POINTS)
        rank = 0 if point in LEADER_ONLY else self.rng.randint(0, 1)
        return kind, {"step": step, "point": point, "rank": rank, "target": self.rng.choice(("tree", "group"))}

    # ------------------------------------------------------------------ one start
    def _kill(self, proc: subprocess.Popen, target: str) -> list[psutil.Process]:
        procs = tree(proc.pid)
        if target.startswith("rank-"):
            rank = int(target.split("-")[1])
            workers = [p for p in procs if environ_rank(p) == rank]
            for p in workers:
                p.send_signal(signal.SIGKILL)
            return procs  # the rest must end by itself (torchrun, then the supervisor)
        if target == "group":
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor alone; the rest dies by PDEATHSIG
            return procs
        for p in procs:  # every process at once: a VM taken away
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        return procs

    def _wait_gone(self, proc: subprocess.Popen, procs: list[psutil.Process], where: str, timeout: float) -> None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.result.violations.append(f"{where}: the supervisor did not exit within {timeout:.0f} s")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        _, alive = psutil.wait_procs(procs, timeout=30)
        alive = [p for p in alive if _alive(p)]
        if alive:
            self.result.orphans += len(alive)
            self.result.violations.append(
                f"{where}: {len(alive)} process(es) outlived the kill: {[p.pid for p in alive]}"
            )
            for p in alive:
                p.kill()

    def _start(self, number: int, kind: Optional[str], plan: dict) -> tuple[Optional[int], Kill | None, int]:
        """Run one start (killed as planned, or to the end). Returns (exit code, kill record, attempt)."""
        if kind in FAULTS:
            return FAULTS[kind](self, number, {**plan, "kind": kind})
        before = attempts_seen(self.run_dir)
        env = {}
        faults = self.work / "faults" / f"start-{number}"
        if kind == "write":
            env = {
                "SKYSPOT_FAULT": f"{plan['point']}@{plan['step']}/{plan['rank']}:hold=600",
                "SKYSPOT_FAULT_DIR": str(faults),
            }
        launched = time.monotonic()
        proc = launch(
            self.run_dir, self.overrides, self.work / "logs" / f"start-{number:03d}.txt", store=self.store, **env
        )
        self.result.starts += 1
        kill = None
        first_step_at = None
        deadline = launched + START_TIMEOUT_S
        if kind == "startup":
            estimate = (
                sorted(self.startup_estimates)[len(self.startup_estimates) // 2] if self.startup_estimates else 20.0
            )
            fire_at = launched + self.rng.uniform(0.05, 1.0) * estimate
        else:
            fire_at = None
        settle_until = None
        progress = 0
        while proc.poll() is None and time.monotonic() < deadline:
            new = attempts_seen(self.run_dir) - before
            reached, times = rank0_steps(self.run_dir, new) if new else (0, [])
            if reached > progress:  # stuck is START_TIMEOUT_S without a step, not a long run's length
                progress, deadline = reached, time.monotonic() + START_TIMEOUT_S
            if reached and first_step_at is None:
                first_step_at = time.monotonic()
                self.startup_estimates.append(first_step_at - launched)
            if times:
                self.step_estimate = sorted(times)[len(times) // 2]
            now = time.monotonic()
            if kind is None:
                pass
            elif kind == "resume" and fire_at is None:
                if reached or any(e["type"] == "resume" for e in self._events(new)):
                    estimate = (
                        sorted(self.startup_estimates)[len(self.startup_estimates) // 2]
                        if self.startup_estimates
                        else 5.0
                    )
                    fire_at = now + self.rng.uniform(0.0, 0.5) * max(0.0, estimate - (now - launched))
            elif kind == "resume" and (now >= fire_at or reached):
                phase = f"at step {reached}" if reached else "after the resume scan"
                kill = Kill(
                    number, kind, plan["target"], None, None, "after the resume scan, before the first step", phase
                )
            elif kind == "startup" and (now >= fire_at or reached):
                phase = f"at step {reached}" if reached else "startup"
                kill = Kill(number, kind, plan["target"], None, None, "random moment before the first step", phase)
            elif kind in ("step", "worker", "wipe") and reached >= plan["step"]:
                if fire_at is None:
                    fire_at = now + self.rng.uniform(0.0, 1.2) * self.step_estimate
                elif now >= fire_at:
                    kill = Kill(
                        number,
                        kind,
                        plan["target"],
                        None,
                        None,
                        f"random moment after step {plan['step']}",
                        f"after step {reached}",
                    )
            elif kind == "write":
                fired = faults / f"{plan['point']}@{plan['step']}.rank{plan['rank']}"
                if fired.exists():
                    time.sleep(self.rng.uniform(0.0, 0.2))  # held: the moment within the hold does not matter
                    kill = Kill(
                        number,
                        kind,
                        plan["target"],
                        None,
                        None,
                        f"{plan['point']}@{plan['step']} rank {plan['rank']}",
                        f"held at {plan['point']}@{plan['step']}/{plan['rank']}",
                    )
                elif reached >= plan["step"] + 2:
                    settle_until = settle_until or now + 20.0
                    if now >= settle_until:  # the point never fired (should not happen): kill anyway
                        kill = Kill(
                            number,
                            kind,
                            plan["target"],
                            None,
                            None,
                            f"{plan['point']}@{plan['step']} rank {plan['rank']} (never fired)",
                            f"after step {reached}",
                        )
            if kill is not None:
                kill.seconds, kill.at = round(now - launched, 3), time.time()
                procs = self._kill(proc, plan["target"])
                self._wait_gone(proc, procs, f"kill {number}", timeout=GRACE_S + 60)
                break
            time.sleep(0.05)
        if proc.poll() is None:
            self.result.violations.append(f"start {number}: no step for {START_TIMEOUT_S:.0f} s, still running")
            procs = tree(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            self._wait_gone(proc, procs, f"start {number}", timeout=30)
        new = attempts_seen(self.run_dir) - before
        attempt = max(new) if new else None
        if kill is not None:
            kill.attempt = attempt
            kill.reached = rank0_steps(self.run_dir, new)[0] if new else 0
        return proc.returncode, kill, attempt

    def _launch(self, number: int, **options) -> subprocess.Popen:
        proc = launch(
            self.run_dir, self.overrides, self.work / "logs" / f"start-{number:03d}.txt", store=self.store, **options
        )
        self.result.starts += 1
        return proc

    def _stop(self, proc: subprocess.Popen) -> None:
        """Whatever is left of a fault's start (after a violation): gone before the next."""
        if proc.poll() is None:
            procs = tree(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            self._wait_gone(proc, procs, "a fault's start", timeout=30)

    def _events(self, attempts: set[int]) -> list[dict]:
        """Rank 0's events of these attempts (rank 0 writes them to its own file)."""
        out = [e for a in attempts for e in read_events(self.run_dir, f"attempt-{a}.node-0.rank-0.jsonl")]
        return sorted((e for e in out if e.get("attempt") in attempts and e.get("rank") == 0), key=lambda e: e["ts"])

    # ------------------------------------------------------------------ the checks around a start
    def _check_start(
        self,
        number: int,
        attempt: Optional[int],
        valid_before: list[int],
        durable_before: list[int],
        killed: bool,
        code: Optional[int],
    ) -> Optional[int]:
        """Check one start's resume; returns the step it resumed from (None: no resume event)."""
        r = self.result
        newest_before = max(valid_before[:1] + durable_before[:1], default=None)
        if attempt is None:
            return None
        events = [e for e in read_events(self.run_dir) if e.get("attempt") == attempt and e.get("rank") == 0]
        steps = [e for e in events if e["type"] == "step"]
        # The start's own resume comes before its first step; a later one is a restart in place's.
        first_step = min((e["ts"] for e in steps), default=math.inf)
        resumes = [e for e in events if e["type"] == "resume" and e["ts"] < first_step]
        resumed = None
        if resumes:
            resumed = resumes[0]["step"]
            r.resumes += 1
            r.resumes_from_store += resumes[0].get("source") == "store"
            r.incomplete_seen += sum("incomplete" in line for line in resumes[0].get("skipped") or [])
            if resumed != newest_before:
                r.violations.append(
                    f"start {number} (attempt {attempt}) resumed from step {resumed}, "
                    f"the newest valid checkpoint was {newest_before}"
                )
            if resumed not in valid_before and resumed not in durable_before:
                r.violations.append(f"start {number} resumed from step {resumed}, which was not a valid checkpoint")
        elif steps and newest_before is not None:
            r.violations.append(f"start {number} trained from step 0 although step {newest_before} was valid")
        if not killed and code not in (0,):
            r.violations.append(f"start {number} ended by itself with code {code}")
        if killed and code == 0:
            r.violations.append(f"start {number} completed although it was killed")
        return resumed

    def _check_nothing_lost(
        self,
        number: int,
        valid_before: list[int],
        valid_after: list[int],
        durable_before: list[int],
        durable_after: list[int],
        committed_events: list[int],
    ) -> None:
        r = self.result
        where = f"after start {number}"
        if self.wipe or self._wiping:  # the local disk goes with the kill by design: only the store's copies count
            valid_before, valid_after, committed_events = [], [], []
        if valid_before and (not valid_after or valid_after[0] < valid_before[0]):
            r.lost_committed += 1
            r.violations.append(
                f"{where}: the newest valid checkpoint went back from {valid_before[0]} to {valid_after[:1] or None}"
            )
        for step in sorted(set(valid_before) | set(committed_events)):
            if step in valid_after:
                continue
            newer = [s for s in valid_after if s > step]
            if len(newer) < self.keep:  # retention keeps the newest `keep`; only older ones may go
                r.lost_committed += 1
                r.violations.append(
                    f"{where}: committed step {step} is gone with only {len(newer)} newer valid "
                    f"checkpoint(s) (keep={self.keep})"
                )
        if durable_before and (not durable_after or durable_after[0] < durable_before[0]):
            r.lost_committed += 1
            r.rolled_back += 1
            r.violations.append(
                f"{where}: the newest durable checkpoint in the store went back from "
                f"{durable_before[0]} to {durable_after[:1] or None}"
            )

    def _progress(self) -> None:
        """The figures so far, in WORK/progress.json after every fault: a soak cut short keeps them."""
        r = self.result
        doc = {**asdict(r), "per_kind": r.per_kind(), "finished": False}
        tmp = self.work / "progress.json.tmp"
        tmp.write_text(json.dumps(doc) + "\n")
        tmp.replace(self.work / "progress.json")

    def _valid(self, where: str) -> list[int]:
        """The checkpoints a start could resume from on this node's disk, newest first."""
        return valid_steps(self.run_dir, self.result, where)

    def _committed(self, attempt: int) -> list[int]:
        """The steps this attempt committed (every node's part)."""
        return [
            e["step"]
            for e in read_events(self.run_dir)
            if e.get("attempt") == attempt and e["type"] == "checkpoint_end"
        ]

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        r = self.result
        began = time.monotonic()
        if self.reference is None:
            self.reference = self.work / "reference"
            self.say(f"reference: uninterrupted run in {self.reference}")
            proc = launch(self.reference, self.overrides, self.work / "logs" / "reference.txt")
            if proc.wait(START_TIMEOUT_S) != 0:
                r.violations.append(f"the reference run failed (code {proc.returncode}); see {self.work / 'logs'}")
                return self._done(began)
        number = 0
        misses = 0
        while True:
            k = len(r.kills)
            if k < len(self.order) and self.stop_at is not None and time.time() >= self.stop_at:
                self.say(f"time limit: {k} of {len(self.order)} faults made; the run finishes without another")
                self.order, r.stopped_early = self.order[:k], True
            kind = self.order[k] if k < len(self.order) else None
            number += 1
            valid_before = self._valid(f"before start {number}")
            durable_before = durable_steps(self.store, self.run_dir.name)
            newest = max(valid_before[:1] + durable_before[:1], default=0)
            plan = {}
            if kind is not None:
                kind, plan = self._plan(kind, newest, len(self.order) - k)
            self._wiping = kind == "wipe"
            code, kill, attempt = self._start(number, kind, plan)
            # A start of a finished run can end (0) before a start-up kill lands: try that kill again.
            retry = kind is not None and kill is None and code == 0 and misses < MAX_MISSES
            if kind is not None and kill is None and not retry:
                r.violations.append(f"start {number}: planned kill ({kind} {plan}) never happened (exit {code})")
            resumed = self._check_start(number, attempt, valid_before, durable_before, kill is not None, code)
            valid_after = self._valid(f"after start {number}")
            durable_after = durable_steps(self.store, self.run_dir.name)
            committed = self._committed(attempt) if attempt else []
            self._check_nothing_lost(number, valid_before, valid_after, durable_before, durable_after, committed)
            if kill is not None and (self.wipe or kill.kind == "wipe"):
                self._wipe_and_verify(number)
            if kill is not None:
                kill.attempt = kill.attempt or attempt
                kill.resumed_from = newest or None
                # The work this kill cost: what the next start must redo (it resumes at the newest valid).
                kill.lost_steps = max(0, kill.reached - max(valid_after[:1] + durable_after[:1], default=0))
                r.kills.append(kill)
                self._progress()
                self.say(
                    f"kill {len(r.kills)}/{len(self.order)}: {kill.kind:7} {kill.target:6} {kill.planned}; "
                    f"landed: {kill.phase}{f', {kill.seconds:.1f} s after launch' if kill.seconds else ''}; started from "
                    f"{newest or 'scratch'}; valid now {valid_after[:3]}"
                )
            elif retry:
                misses += 1
                self.say(f"start {number} ended (exit 0) before its {kind} kill; trying that kill again")
            else:
                r.final_code = code if kind is None else None
                self.say(f"final start: exit {code}, resumed from {resumed}" if kind is None else "stopping")
                break
        self._recoveries()
        r.lost_steps = sum(k.lost_steps for k in r.kills)
        r.durable_uploads = sum(1 for e in read_events(self.run_dir) if e["type"] == "upload_end" and e.get("durable"))
        self._compare(began)
        return self._done(began)

    def _recoveries(self) -> None:
        """Each fault's recovery: the first resume and step after it (of a later attempt; of the same one
        for a restart in place, and for `stale`, whose recovery is the newer attempt's)."""
        events = [e for e in read_events(self.run_dir) if e.get("rank") == 0 and e["type"] in ("resume", "step")]
        for kill in self.result.kills:
            if kill.kind in ("outage", "lossy"):
                continue  # no restart: its recovery is the uploads' catch-up, measured as it happened
            same_ok = kill.kind in ("crash", "hang", "stale")
            after = [e for e in events if e["ts"] > kill.at and (same_ok or e.get("attempt") != kill.attempt)]
            resume = next((e for e in after if e["type"] == "resume"), None)
            step = next((e for e in after if e["type"] == "step"), None)
            kill.resume_source = resume.get("source") if resume else None
            kill.recovery_seconds = round(step["ts"] - kill.at, 2) if step else None

    def _wipe_and_verify(self, number: int) -> None:
        """The node is gone: its local disk with it (event files kept aside for the checks). Then every
        durable checkpoint in the store must still verify."""
        import shutil

        archive = ARCHIVES.setdefault(self.run_dir, self.work / "events-archive")
        archive.mkdir(parents=True, exist_ok=True)
        for path in (self.run_dir / "events").glob("*.jsonl"):
            shutil.copy2(path, archive / path.name)  # a later start may reuse an attempt number: newest wins
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.result.wipes += 1
        checked, problems = verify_durable(self.store, self.run_dir.name)
        self.result.durable_verified += checked
        self.result.durable_corrupt += len(problems)
        self.result.violations += [f"after kill {number}: {p}" for p in problems]

    def _compare(self, began: float) -> None:
        import torch
        from safetensors.torch import load_file

        r = self.result
        expected = {
            e["step"]: (e["loss"], e["lr"])
            for e in read_events(self.reference)
            if e["type"] == "step" and e.get("rank") == 0
        }
        for event in read_events(self.run_dir):
            if event["type"] == "step" and event.get("rank") == 0:
                r.steps_compared += 1
                if (event["loss"], event["lr"]) != expected.get(event["step"]):
                    r.violations.append(
                        f"attempt {event['attempt']} step {event['step']}: loss/lr "
                        f"{(event['loss'], event['lr'])} != reference {expected.get(event['step'])}"
                    )
        ours_path = self.run_dir / "final" / "model.safetensors"
        theirs_path = self.reference / "final" / "model.safetensors"
        if not ours_path.exists() or not theirs_path.exists():
            r.violations.append(f"final model missing: {ours_path if not ours_path.exists() else theirs_path}")
            return
        ours, theirs = load_file(ours_path), load_file(theirs_path)
        different = [k for k in theirs if k not in ours or not torch.equal(ours[k], theirs[k])]
        r.final_equal = ours.keys() == theirs.keys() and not different
        if not r.final_equal:
            r.violations.append(f"final parameters differ from the reference: {different[:5]}")

    def _done(self, began: float) -> Result:
        self.result.seconds = round(time.monotonic() - began, 1)
        return self.result


# --------------------------------------------------------------------------- the faults beyond a kill
# Each runs one start in run_dir (and, for `stale`, an older attempt beside it) and returns what
# Harness._start returns. The fault is injected as the per-fault tests inject it: a SIGTERM to every
# process of the node as a cloud's shutdown sends it (tests/trainer/test_exit_and_supervise.py), a SIGKILLed
# rank restarted in place by torchrun (tests/reliability/test_restart_in_place.py), a SIGSTOPped rank the
# watchdog finds (tests/trainer/test_watchdog_e2e.py), and an older attempt held at step_end while a newer
# one takes the store (tests/reliability/test_two_attempts.py).


def _sigterm_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    procs = tree(proc.pid)
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    return procs


def _until(
    h: Harness, what: str, done, procs: subprocess.Popen | list[subprocess.Popen], timeout: float = 240.0
) -> bool:
    """`done()` within `timeout`, while the start (every node of it) runs; else a violation."""
    procs = procs if isinstance(procs, list) else [procs]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            h.result.violations.append(f"{what}: the start ended (code {ended[0].returncode}) first")
            return False
        time.sleep(0.05)
    h.result.violations.append(f"{what}: not within {timeout:.0f} s")
    return False


def _end_by_notice(h: Harness, proc: subprocess.Popen, window: float, where: str) -> Optional[int]:
    """SIGTERM the node's tree and give it the notice window: it must commit and exit 75 within it."""
    from skyspot.trainer.exit_codes import PREEMPTED

    procs = _sigterm_tree(proc)
    began = time.monotonic()
    h._wait_gone(proc, procs, where, timeout=window)
    if proc.returncode != PREEMPTED:
        h.result.violations.append(f"{where}: exit {proc.returncode} after the notice, not {PREEMPTED}")
    elif time.monotonic() - began > window:
        h.result.violations.append(f"{where}: took {time.monotonic() - began:.0f} s, past the {window:.0f} s window")
    return proc.returncode


def _new_attempt(h: Harness, before: set[int]) -> Optional[int]:
    new = attempts_seen(h.run_dir) - before
    return max(new) if new else None


def _reached(h: Harness, before: set[int]) -> int:
    new = attempts_seen(h.run_dir) - before
    return rank0_steps(h.run_dir, new)[0] if new else 0


def _rank_pids(proc: subprocess.Popen, rank: int) -> list[psutil.Process]:
    return [p for p in tree(proc.pid) if environ_rank(p) == rank]


def fault_notice(h: Harness, number: int, plan: dict):
    """A preemption notice at a random step: SIGTERM to the tree, the cloud's window to commit in."""
    window = NOTICE_WINDOWS_S[plan["cloud"]]
    before = attempts_seen(h.run_dir)
    proc = h._launch(number, grace=window)
    kill = Kill(
        number, "notice", "tree", None, None, f"SIGTERM after step {plan['step']} ({plan['cloud']}, {window:.0f} s)"
    )
    if _until(h, f"notice {number}", lambda: _reached(h, before) >= plan["step"], proc):
        time.sleep(h.rng.uniform(0.0, 1.0) * h.step_estimate)
        kill.at, kill.phase = time.time(), f"after step {_reached(h, before)}"
        kill.code = _end_by_notice(h, proc, window, f"notice {number}")
    attempt = _new_attempt(h, before)
    emergency = [e for e in h._events({attempt} if attempt else set()) if e["type"] == "emergency_checkpoint"]
    kill.reached = _reached(h, before)
    if not emergency:
        h.result.violations.append(f"notice {number}: no emergency_checkpoint event")
    elif emergency[0]["step"] != kill.reached:
        h.result.violations.append(
            f"notice {number}: the emergency checkpoint is step {emergency[0]['step']}, the last step {kill.reached}"
        )
    h._stop(proc)
    return proc.returncode, kill, attempt


def fault_in_place(h: Harness, number: int, plan: dict):
    """crash: SIGKILL one rank mid-step; hang: SIGSTOP one (the watchdog must find it). torchrun restarts
    the ranks in place, in the same attempt, from the local tier; then the node gets a notice."""
    kind, rank = plan["kind"], int(plan["target"].split("-")[1])
    before = attempts_seen(h.run_dir)
    proc = h._launch(number, in_place=True)
    what = "SIGKILL" if kind == "crash" else "SIGSTOP"
    kill = Kill(number, kind, plan["target"], None, None, f"{what} rank {rank} after step {plan['step']}")
    if _until(h, f"{kind} {number}", lambda: _reached(h, before) >= plan["step"], proc):
        time.sleep(h.rng.uniform(0.0, 1.0) * h.step_estimate)
        kill.at, kill.phase = time.time(), f"after step {_reached(h, before)}"
        for p in _rank_pids(proc, rank):
            p.send_signal(signal.SIGKILL if kind == "crash" else signal.SIGSTOP)

        def restarted() -> list[dict]:
            events = h._events(attempts_seen(h.run_dir) - before)
            back = [e for e in events if e["type"] == "restart_in_place" and e["ts"] > kill.at]
            return [e for e in events if e["type"] == "step" and back and e["ts"] > back[0]["ts"]] and back

        bound = HANG_FLOOR_S * 3 + 120
        if _until(h, f"{kind} {number}: a restart in place", restarted, proc, timeout=bound):
            event = restarted()[0]
            if event["cause"] != kind:
                h.result.violations.append(f"{kind} {number}: restarted in place for a {event['cause']}")
            kill.lost_steps = event["steps_redone"]
            time.sleep(h.rng.uniform(0.0, 1.0) * h.step_estimate)
            kill.code = _end_by_notice(h, proc, GRACE_S + 30, f"{kind} {number}")
    kill.reached = _reached(h, before)
    h._stop(proc)
    return proc.returncode, kill, _new_attempt(h, before)


def fault_stale(h: Harness, number: int, plan: dict):
    """An older attempt A (on a disk of its own, resumed from the store) is alive when this start B takes
    the store: A, let go, must exit STALE and commit nothing; B goes on."""
    from skyspot.storage import open_store
    from skyspot.trainer import fence
    from skyspot.trainer.exit_codes import STALE

    assert h.store is not None
    store = open_store(h.store)
    hold = durable_steps(h.store, h.run_dir.name)[0] + 1
    side = h.work / f"stale-{number}" / h.run_dir.name
    faults = h.work / "faults" / f"stale-{number}"
    older = launch(
        side,
        h.overrides,
        h.work / "logs" / f"start-{number:03d}.older.txt",
        store=h.store,
        grace=GRACE_S,
        SKYSPOT_FAULT=f"step_end@{hold}:hold=600",
        SKYSPOT_FAULT_DIR=str(faults),
    )
    kill = Kill(number, "stale", "attempt", None, None, f"an older attempt held at step {hold} as this one starts")
    before = attempts_seen(h.run_dir)
    proc = None
    if _until(h, f"stale {number}: A held", lambda: len(list(faults.glob(f"step_end@{hold}.rank*"))) == 2, older):
        epoch = (fence.read(store, h.run_dir.name) or {}).get("epoch", 0)
        proc = h._launch(number)
        kill.at = time.time()
        if _until(
            h,
            f"stale {number}: B takes the store",
            lambda: (fence.read(store, h.run_dir.name) or {}).get("epoch", 0) > epoch,
            proc,
        ):
            for fired in faults.glob(f"step_end@{hold}.rank*"):
                (fired.parent / (fired.name + ".release")).touch()
            try:
                code = older.wait(120)
            except subprocess.TimeoutExpired:
                code = None
            if code != STALE:
                h.result.violations.append(f"stale {number}: the older attempt exited {code}, not {STALE}")
            else:
                h.result.stale_refused += 1
            commits = (fence.read(store, h.run_dir.name) or {}).get("commits", {})
            late = {step: by for step, by in commits.items() if int(step) >= hold and epoch in set(by.values())}
            if late:
                h.result.violations.append(f"stale {number}: the older attempt committed after B started: {late}")
            kill.phase = f"older held at step {hold}, exit {code}"
            target = min(h.steps - 1, _reached(h, before) + 1 + h.rng.randint(0, 2))
            if _until(h, f"stale {number}: B trains on", lambda: _reached(h, before) >= target, proc):
                kill.code = _end_by_notice(h, proc, GRACE_S + 30, f"stale {number}")
    h._stop(older)
    if proc is None:
        return older.returncode, kill, None
    kill.reached = _reached(h, before)
    h._stop(proc)
    return proc.returncode, kill, _new_attempt(h, before)


def fault_emergency(h: Harness, number: int, plan: dict):
    """A notice at step S (both ranks held at its end, so the emergency checkpoint is S's), then a SIGKILL
    while the writer of that checkpoint is held at a random point."""
    step, point, rank = plan["step"], plan["point"], plan["rank"]
    faults = h.work / "faults" / f"start-{number}"
    before = attempts_seen(h.run_dir)
    proc = h._launch(
        number,
        grace=NOTICE_WINDOWS_S[plan["cloud"]],
        SKYSPOT_FAULT=f"step_end@{step}:hold=600,{point}@{step}/{rank}:hold=600",
        SKYSPOT_FAULT_DIR=str(faults),
    )
    kill = Kill(number, "emergency", plan["target"], None, None, f"notice at step {step}, kill at {point}/{rank}")
    if _until(h, f"emergency {number}", lambda: len(list(faults.glob(f"step_end@{step}.rank*"))) == 2, proc):
        _sigterm_tree(proc)
        time.sleep(0.5)  # the handlers set the flag; the step's vote carries it
        for fired in faults.glob(f"step_end@{step}.rank*"):
            (fired.parent / (fired.name + ".release")).touch()
        held = faults / f"{point}@{step}.rank{rank}"
        if _until(h, f"emergency {number}: the writer held at {point}", held.exists, proc, timeout=60):
            time.sleep(h.rng.uniform(0.0, 0.2))
            kill.at, kill.phase = time.time(), f"emergency writer held at {point}@{step}/{rank}"
            procs = h._kill(proc, plan["target"])
            h._wait_gone(proc, procs, f"emergency {number}", timeout=GRACE_S + 60)
    kill.reached = _reached(h, before)
    h._stop(proc)
    return proc.returncode, kill, _new_attempt(h, before)


def fault_outage(h: Harness, number: int, plan: dict):
    """The store unreachable for a few seconds mid-run (moto's server stopped: connections refused): training
    goes on, and once the store is back the uploads catch up (recovery: from its return to the newest local
    checkpoint durable); then the node gets a notice."""
    assert h.s3 is not None
    before = attempts_seen(h.run_dir)
    proc = h._launch(number)
    kill = Kill(number, "outage", "store", None, None, f"store down after step {plan['step']}")
    if _until(h, f"outage {number}", lambda: _reached(h, before) >= plan["step"], proc):
        down_s = h.rng.uniform(2.0, 8.0)
        h.s3.stop()
        kill.at, stopped_at = time.time(), _reached(h, before)
        try:
            # Down for down_s, and on until a step is made without the store (a loaded machine's step can
            # outlast the planned outage: the point is that training goes on, within OUTAGE_STEP_S).
            time.sleep(down_s)
            limit = time.monotonic() + OUTAGE_STEP_S
            while _reached(h, before) <= stopped_at and proc.poll() is None and time.monotonic() < limit:
                time.sleep(0.2)
        finally:
            h.s3.start()
        back = time.time()
        down_s = back - kill.at
        kill.phase = f"down {down_s:.1f} s from step {stopped_at}"
        trained = _reached(h, before)
        if trained <= stopped_at and proc.poll() is None:
            h.result.violations.append(f"outage {number}: no step during the {down_s:.1f} s outage")
        target = min(h.steps - 1, trained + 1)
        if _until(h, f"outage {number}: trains on", lambda: _reached(h, before) >= target, proc):
            local = max(valid_steps(h.run_dir, h.result, f"outage {number}")[:1] or [0])

            def caught_up() -> bool:
                return max(durable_steps(h.store, h.run_dir.name)[:1] or [0]) >= local

            if _until(h, f"outage {number}: uploads catch up to step {local}", caught_up, proc, timeout=120):
                kill.recovery_seconds = round(time.time() - back, 2)
            kill.phase += f", {trained - stopped_at} step(s) trained meanwhile"
            kill.code = _end_by_notice(h, proc, GRACE_S + 30, f"outage {number}")
    kill.reached = _reached(h, before)
    h._stop(proc)
    return proc.returncode, kill, _new_attempt(h, before)


def _s3_server():
    """moto's S3 server in this process (tests/storage_servers.py), reachable by the starts on loopback."""
    from tests.storage_servers import HOST, S3Server

    server = S3Server()
    server.start()
    os.environ.update(
        AWS_ENDPOINT_URL=server.url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY=",".join(filter(None, [os.environ.get("NO_PROXY", ""), HOST, "localhost"])),
    )
    os.environ["no_proxy"] = os.environ["NO_PROXY"]
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(name, None)
    EXTRA_ENV.update(SKYSPOT_STORE_RETRY_MAX_SECONDS="1", SKYSPOT_EVENTS_SYNC_SECONDS="1")
    return server


# --------------------------------------------------------------------------- the network lane
# Link cuts, partitions, a frozen node and a lossy link need hosts with their own addresses: a run of
# two nodes, one rank each (the same world of 2 as the other lanes, so the same reference), each node
# on a network namespace of its own (skyspot/executors/local/netns.py), with SKYPILOT_NODE_IPS,
# --local_addr and gloo on the namespace's interface as on a cloud. Every start of that run is two
# nodes; its store is a local directory both reach (the namespaces share this machine's disk).
# tests/reliability/test_silent_node_loss.py is the single-fault form these follow.

NET_DIST_TIMEOUT_S = 10
"""SKYSPOT_DIST_TIMEOUT_SECONDS of the network lane: a silent peer stops a node's collective after this."""
NET_SLACK_S = 40
"""After the collective timeout: the trainer's way out, torchrun's teardown and the supervisor's exit."""


def launch_node(
    hosts, k: int, run_dir: Path, overrides: list[str], log: Path, *, store: str, port: int, grace: float = GRACE_S
) -> subprocess.Popen:
    """Node k of 2 on host k: `supervise -- torchrun --nnodes 2 --node_rank k --local_addr <host k> ...`."""
    command, env = host_node(
        hosts,
        k,
        run_dir,
        ["--run-name", run_dir.name, f"storage.store={store}", *overrides],
        port,
        supervise=("--grace", str(grace)),
        **EXTRA_ENV,
        SKYSPOT_DIST_TIMEOUT_SECONDS=str(NET_DIST_TIMEOUT_S),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


class NetHarness(Harness):
    """The network lane: every start is two nodes on hosts of their own; node 0's run directory is
    `run_dir` (rank 0's events, final/), node 1's lies beside it under `node1/`."""

    def __init__(self, *, hosts, **options):
        super().__init__(store=True, **options)
        self.hosts = hosts  # self.store: a local directory (store=True), which both namespaces reach
        self.node_dirs = [self.run_dir, self.work / "node1" / self.run_dir.name]

    def _plan(self, kind: str, newest: int, remaining: int) -> tuple[str, dict]:
        n = self.steps
        if kind not in NET_KINDS:
            return super()._plan(kind, newest, remaining)
        if newest >= n - ROOM - 1:
            return "startup", {"target": self.rng.choice(("tree", "group"))}
        plan = {"step": self._target_step(newest, remaining, n - ROOM), "node": self.rng.randint(0, 1)}
        if kind == "lossy":
            plan.update(loss_pct=round(self.rng.uniform(2.0, 15.0), 1), seconds=round(self.rng.uniform(2.0, 6.0), 1))
        return kind, plan

    def _valid(self, where: str) -> list[int]:
        """A step counts when every node holds a valid part of it (the start's vote takes the newest such)."""
        per_node = [set(valid_steps(d, self.result, f"{where}, node {k}")) for k, d in enumerate(self.node_dirs)]
        return sorted(set.intersection(*per_node), reverse=True)

    def _committed(self, attempt: int) -> list[int]:
        per_node = [
            {e["step"] for e in read_events(d) if e.get("attempt") == attempt and e["type"] == "checkpoint_end"}
            for d in self.node_dirs
        ]
        return sorted(set.intersection(*per_node))

    def launch_nodes(self, number: int, grace: float = GRACE_S) -> list[subprocess.Popen]:
        port = free_port()
        self.result.starts += 1
        return [
            launch_node(
                self.hosts,
                k,
                d,
                self.overrides,
                self.work / "logs" / f"start-{number:03d}.node-{k}.txt",
                store=self.store,  # type: ignore[arg-type]
                port=port,
                grace=grace,
            )
            for k, d in enumerate(self.node_dirs)
        ]

    def _start(self, number: int, kind: Optional[str], plan: dict) -> tuple[Optional[int], Kill | None, int]:
        if kind in NET_KINDS:
            return fault_network(self, number, {**plan, "kind": kind})
        if kind is not None:
            return fault_node_kill(self, number, {**plan, "kind": kind})
        before = attempts_seen(self.run_dir)
        procs = self.launch_nodes(number)
        codes = _wait_nodes(self, procs, START_TIMEOUT_S, f"start {number}", progress=lambda: _reached(self, before))
        return max(codes, key=abs), None, _new_attempt(self, before)


def _wait_nodes(h: Harness, procs: list[subprocess.Popen], timeout: float, where: str, progress=None) -> list[int]:
    """Every node's supervisor gone within `timeout` (else a violation, and killed); with `progress` (rank
    0's newest step), within `timeout` of the last new step: a long run to the end is not a stuck one."""
    deadline, reached = time.monotonic() + timeout, 0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if progress is not None and (now := progress()) > reached:
            reached, deadline = now, time.monotonic() + timeout
        time.sleep(0.05 if progress is None else 0.5)
    for k, p in enumerate(procs):
        if p.poll() is None:
            h.result.violations.append(
                f"{where}: node {k} still up {timeout:.0f} s on" + (" without a step" if progress else "")
            )
            h._stop(p)
    return [p.returncode for p in procs]


def fault_node_kill(h: "NetHarness", number: int, plan: dict):
    """A start-up kill of the two-node run (a kind the lane degrades to near the end): node 0's tree at once."""
    before = attempts_seen(h.run_dir)
    procs = h.launch_nodes(number)
    kill = Kill(number, "startup", "node-0", None, None, "random moment before the first step (two nodes)")
    time.sleep(h.rng.uniform(0.5, 6.0))
    kill.at, kill.phase = time.time(), f"at step {_reached(h, before)}" if _reached(h, before) else "startup"
    for p in procs:
        killed = h._kill(p, "tree")
        h._wait_gone(p, killed, f"kill {number}", timeout=GRACE_S + 60)
    kill.reached = _reached(h, before)
    return procs[0].returncode, kill, _new_attempt(h, before)


def fault_network(h: "NetHarness", number: int, plan: dict):
    """cut / partition: host k's link silent (every packet dropped, nothing reset) or cut off from the other
    host; freeze: every process of host k SIGSTOPped. The other node's collective must time out (not at once:
    nothing closed its sockets; not much later), every node must exit, then the link heals and the next
    start resumes. lossy: 2 to 15 % of host k's packets dropped for a few seconds: training goes on."""
    kind, k = plan["kind"], plan["node"]
    hosts = h.hosts
    before = attempts_seen(h.run_dir)
    procs = h.launch_nodes(number)
    what = {"cut": "link cut", "partition": "partitioned", "freeze": "frozen", "lossy": "lossy link"}[kind]
    kill = Kill(number, kind, f"node-{k}", None, None, f"node {k} {what} after step {plan['step']}")
    try:
        if _until(h, f"{kind} {number}", lambda: _reached(h, before) >= plan["step"], procs):
            time.sleep(h.rng.uniform(0.0, 1.0) * h.step_estimate)
            kill.at, kill.phase = time.time(), f"after step {_reached(h, before)}"
            at = time.monotonic()
            if kind == "lossy":
                _lossy(h, number, kill, plan, procs, before)
            else:
                {"cut": hosts.cut, "partition": hosts.partition, "freeze": hosts.freeze}[kind](k)
                _stops_on_its_timeout(h, number, kill, procs, k, at)
    finally:
        hosts.thaw(k)
        hosts.heal(k)
        for p in procs:
            h._stop(p)
    kill.reached = _reached(h, before)
    return procs[0].returncode, kill, _new_attempt(h, before)


def _stops_on_its_timeout(h: "NetHarness", number: int, kill: Kill, procs: list, k: int, at: float) -> None:
    """The node that can still run stops on its collective timeout; a frozen node, thawed, stops too."""
    other, where = procs[1 - k], f"{kill.kind} {number}"
    bound = NET_DIST_TIMEOUT_S + NET_SLACK_S
    while other.poll() is None and time.monotonic() - at < bound:
        time.sleep(0.05)
    noticed = time.monotonic() - at
    kill.noticed_seconds = round(noticed, 2)
    if other.poll() is None:
        h.result.violations.append(f"{where}: node {1 - k} still up {noticed:.0f} s after node {k} went {kill.kind}")
    elif noticed < NET_DIST_TIMEOUT_S - 1:
        h.result.violations.append(
            f"{where}: node {1 - k} stopped {noticed:.1f} s on, before its {NET_DIST_TIMEOUT_S} s collective "
            "timeout: something reset its connections"
        )
    elif other.returncode == 0:
        h.result.violations.append(f"{where}: node {1 - k} ended 0 with its peer gone")
    if kill.kind == "freeze":
        h.hosts.thaw(k)  # the VM comes back (or its processes are reclaimed): nothing of it may live on
    _wait_nodes(h, procs, bound, where)
    kill.code = other.returncode
    kill.phase += f"; node {1 - k} stopped {noticed:.1f} s on (code {other.returncode})"


def _lossy(h: "NetHarness", number: int, kill: Kill, plan: dict, procs: list, before: set[int]) -> None:
    """Packets lost for a few seconds: TCP retransmits, the collectives only slow down; then a notice."""
    k, where = plan["node"], f"lossy {number}"
    reached = _reached(h, before)
    h.hosts.netem(k, loss_pct=plan["loss_pct"])
    try:
        time.sleep(plan["seconds"])
    finally:
        h.hosts.heal(k)
    back = time.time()
    kill.phase += (
        f"; {plan['loss_pct']} % lost for {plan['seconds']} s, {_reached(h, before) - reached} step(s) meanwhile"
    )
    if any(p.poll() is not None for p in procs):
        h.result.violations.append(f"{where}: a node stopped on a lossy link (codes {[p.poll() for p in procs]})")
        return
    target = min(h.steps - 1, _reached(h, before) + 1)
    if _until(h, f"{where}: trains on", lambda: _reached(h, before) >= target, procs):
        kill.recovery_seconds = round(time.time() - back, 2)
        for p in procs:
            _sigterm_tree(p)
        codes = _wait_nodes(h, procs, GRACE_S + 30, where)
        from skyspot.trainer.exit_codes import PREEMPTED

        if codes != [PREEMPTED, PREEMPTED]:
            h.result.violations.append(f"{where}: exits {codes} after the notice, not {PREEMPTED} on both nodes")
        kill.code = codes[0]


FAULTS = {
    "outage": fault_outage,
    "notice": fault_notice,
    "crash": fault_in_place,
    "hang": fault_in_place,
    "stale": fault_stale,
    "emergency": fault_emergency,
}


def run(
    seed: int,
    kills: int,
    steps: int = 24,
    every: int = 1,
    keep: int = 3,
    work: Optional[Path] = None,
    reference: Optional[Path] = None,
    store: bool = False,
    say=None,
    wipe: bool = False,
    kinds: tuple[str, ...] = KINDS,
    lanes: int = 1,
    stop_after: Optional[float] = None,
    part: Optional[tuple[int, int]] = None,
) -> Result:
    """The harness as a function (tests/reliability/test_random_kills.py calls it).

    Network kinds run in a lane of their own (two nodes on hosts of their own), beside the other kinds'
    lane; `lanes` > 1 runs that many lanes of each side by side, each its own run with its own seed and
    share of the faults, all against one reference run: a soak on a machine with idle cores (the lanes
    wait on timeouts and notice windows much of the time) goes faster. The results are merged. With
    `stop_after` (seconds from now), no start after it is given a fault: each lane's run then finishes
    uninterrupted and is compared bitwise as ever (the soak goes on past the limit by that finish), so a soak
    sized by a clock still ends checked.

    It leaves the process as it found it: the outage kind's moto server is stopped, and the environment
    that pointed the SDKs at it is restored. A test process goes on after the soak, and a later test's
    trainers that inherited AWS_ENDPOINT_URL would reach this server (moto's backend is shared by every
    server in the process), so stopping their own server would be no outage (CI saw exactly that).

    `part` (K, N) runs only part K of N of the plan: the lanes whose index on their side is K-1 modulo N
    (`lanes_of_part`), against a reference run of the whole plan's length; `merge_parts` joins the N parts'
    results into the whole plan's. A soak longer than a machine can be held runs so, part by part."""
    work = Path(work) if work else Path(tempfile.mkdtemp(prefix="skyspot-kills-"))
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    stop_at = None if stop_after is None else time.time() + stop_after
    options = dict(steps=steps, every=every, keep=keep, store=store, wipe=wipe, stop_at=stop_at)
    plan = lane_plan(seed, kills, kinds, lanes)
    commit = source_commit()  # the code that runs, as it is when the soak begins
    if part is not None:
        plan = lanes_of_part(plan, *part)
    elif len(plan) == 1 and not plan[0].net:
        result = _run_lane(plan[0], work, reference, say, options)
        result.commit, result.plan_faults = commit, kills
        return result
    began = time.monotonic()
    if reference is None:
        reference = work / "reference"
        say(f"reference: uninterrupted run in {reference}")
        proc = launch(reference, overrides_for(steps, every, keep), work / "logs" / "reference.txt")
        if proc.wait(START_TIMEOUT_S) != 0:
            failed = Result(seed, kills, steps, every, keep, store, work=str(work), kinds=list(kinds))
            failed.violations.append(f"the reference run failed (code {proc.returncode}); see {work / 'logs'}")
            failed.commit, failed.plan_faults, failed.lanes_per_side = commit, kills, lanes
            failed.part = f"{part[0]}/{part[1]}" if part else ""
            return failed
    digest = final_digest(reference)
    results: dict[str, Result] = {}

    def one(lane: Lane) -> None:
        try:
            results[lane.name] = _run_lane_process(lane, work / lane.name, reference, say, options)
        except Exception as err:  # noqa: BLE001 - a lane that broke is a violation of the soak, not its end
            broken = Result(lane.seed, lane.faults, steps, every, keep, store, work=str(work / lane.name))
            broken.violations.append(f"the lane broke: {type(err).__name__}: {err}")
            results[lane.name] = broken

    import threading

    threads = [threading.Thread(target=one, args=(lane,), name=lane.name) for lane in plan]
    for thread in threads:
        thread.start()
        time.sleep(2.0)  # the lanes' first starts apart: their imports share the cores
    for thread in threads:
        thread.join()
    merged = merge([results[lane.name] for lane in plan], plan, seed, sum(lane.faults for lane in plan), kinds, work)
    merged.seconds = round(time.monotonic() - began, 1)
    merged.commit, merged.reference_sha256, merged.plan_faults, merged.lanes_per_side = (
        commit,
        digest,
        kills,
        lanes,
    )
    merged.part = f"{part[0]}/{part[1]}" if part else ""
    return merged


@dataclass
class Lane:
    name: str
    seed: int
    faults: int
    kinds: tuple[str, ...]
    net: bool
    index: int = 0
    """The lane's place on its side (lane-<index>, net-<index>)."""


def lane_plan(seed: int, kills: int, kinds: tuple[str, ...], lanes: int) -> list[Lane]:
    """The faults split between the lanes: the network kinds' share (by their number among `kinds`) to the
    network lanes, the rest to the others, evenly; lane i of a side runs seed + i (network: + 100 + i)."""
    node = tuple(k for k in kinds if k not in NET_KINDS)
    net = tuple(k for k in kinds if k in NET_KINDS)
    net_total = round(kills * len(net) / len(kinds)) if node else kills
    out = []
    for side, side_kinds, total, base in (("lane", node, kills - net_total, 0), ("net", net, net_total, 100)):
        if not side_kinds:
            continue
        n = max(1, min(lanes, total))
        for i in range(n):
            share = total // n + (i < total % n)
            if share:
                out.append(Lane(f"{side}-{i}", seed + base + i, share, side_kinds, side == "net", i))
    return out or [Lane("lane-0", seed, 0, node or KINDS, False)]


def lanes_of_part(plan: list[Lane], k: int, n: int) -> list[Lane]:
    """Part k of n (1 <= k <= n): the lanes whose index on their side is k-1 modulo n, so that every lane is in
    exactly one part and each part runs lanes of both sides (node kinds and network kinds) side by side."""
    if not 1 <= k <= n:
        raise ValueError(f"part {k}/{n}: k must be 1 to {n}")
    for side in {lane.net for lane in plan}:
        count = sum(lane.net == side for lane in plan)
        if count < n:
            raise ValueError(
                f"part {k}/{n}: the plan has {count} {'network' if side else 'node'} lane(s), fewer than its {n} "
                f"parts; give --lanes {n} or more (a multiple of {n} keeps the parts even)"
            )
    return [lane for lane in plan if lane.index % n == k - 1]


def parse_part(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit()) or not 1 <= int(k) <= int(n):
        raise ValueError(f"--part {text!r}: expected K/N with 1 <= K <= N, e.g. 1/6")
    return int(k), int(n)


def source_commit() -> str:
    """The commit the soak's code came from, "+dirty" when tracked files differ from it ("" outside git)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        changed = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if head.returncode:
        return ""
    return head.stdout.strip() + ("+dirty" if changed.stdout.strip() else "")


def final_digest(run_dir: Path) -> str:
    import hashlib

    path = run_dir / "final" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


class PartsError(ValueError):
    """Part results that are not the parts of one plan."""


PLAN_FIELDS = ("seed", "plan_faults", "kinds", "lanes_per_side", "steps", "every_steps", "keep", "store", "wipe")


def merge_parts(docs: list[dict]) -> Result:
    """The whole plan's result from its parts' results (each a --json file of a --part run): they must be
    parts 1..N of one plan (seed, faults, kinds, lanes, steps), run from one commit of a clean tree, each
    with its reference's digest recorded: then counts are summed, faults, violations and lanes put together
    (named by part), and the wall time is the parts' sum (they ran one after another). The parts of one
    machine share a reference; another machine runs its own, and where its CPU rounds differently that
    reference ends with other parameters (each part's lanes are compared with their own machine's
    reference, bitwise), which the summary counts (`reference_variants`) instead of refusing."""
    if not docs:
        raise PartsError("no part results given")
    if not all(isinstance(doc, dict) for doc in docs):
        raise PartsError("a part result is not a JSON object (a --json file of a --part run)")
    parts = []
    for doc in docs:
        if not doc.get("part") or not isinstance(doc["part"], str):
            raise PartsError(f"seed {doc.get('seed')}: not a part (run with --part K/N)")
        parts.append(parse_part(doc["part"]))
    n = parts[0][1]
    if any(p[1] != n for p in parts):
        raise PartsError(f"parts of different splits: {', '.join(d['part'] for d in docs)}")
    numbers = sorted(p[0] for p in parts)
    if numbers != list(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(numbers))
        doubled = sorted({k for k in numbers if numbers.count(k) > 1})
        raise PartsError(
            f"parts of {n}: "
            + "; ".join(
                x for x in (f"missing {missing}" if missing else "", f"given twice {doubled}" if doubled else "") if x
            )
        )
    first = docs[0]
    for name in (*PLAN_FIELDS, "commit"):
        values = {json.dumps(doc.get(name)) for doc in docs}
        if len(values) > 1:
            raise PartsError(f"the parts differ in {name}: {', '.join(sorted(values))}")
    commit = first.get("commit")
    if not isinstance(commit, str) or not commit or commit.endswith("+dirty"):
        raise PartsError(
            f"the parts ran from {'a tree with uncommitted changes' if commit else 'no git commit'} "
            f"({commit or 'none recorded'}): the code they ran is not recorded"
        )
    digests = {doc.get("reference_sha256") for doc in docs}
    if "" in digests or None in digests:
        raise PartsError("a part's reference run is unrecorded (no reference_sha256)")
    results = sorted((result_from_json(doc) for doc in docs), key=lambda r: parse_part(r.part)[0])
    out = Result(
        first["seed"], first["plan_faults"], first["steps"], first["every_steps"], first["keep"], first["store"]
    )
    out.kinds, out.wipe, out.plan_faults, out.lanes_per_side = (
        list(first["kinds"]),
        first["wipe"],
        first["plan_faults"],
        first["lanes_per_side"],
    )
    out.commit, out.parts, out.reference_variants = commit, n, len(digests)
    out.reference_sha256 = " ".join(sorted(str(d) for d in digests))
    out.work = ", ".join(r.work for r in results)
    for r in results:
        out.lanes += [f"part {r.part}: {lane}" for lane in r.lanes]
        out.seconds += r.seconds
    return _joined(out, [(f"part {r.part}", r) for r in results])


def _run_lane_process(lane: Lane, work: Path, reference: Path, say, options: dict) -> Result:
    """One lane in a process of its own (this script, `--lane`): a node lane's moto server and the
    environment that points its SDKs there are per process, and moto's backend is shared by every server
    in a process, so lanes in one process would take each other's fence (exit 76) and outages."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "result.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--lane",
        lane.name,
        "--seed",
        str(lane.seed),
        "--faults",
        str(lane.faults),
        "--kinds",
        ",".join(lane.kinds),
        "--steps",
        str(options["steps"]),
        "--every",
        str(options["every"]),
        "--keep",
        str(options["keep"]),
        "--work",
        str(work),
        "--reference",
        str(reference),
        "--json",
        str(out),
        *(["--store"] if options["store"] else []),
        *(["--wipe"] if options["wipe"] else []),
        *(["--stop-at", repr(options["stop_at"])] if options.get("stop_at") is not None else []),
    ]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        say(f"[{lane.name}] {line.rstrip()}")
    proc.wait()
    if not out.exists():
        raise RuntimeError(f"the lane's process ended {proc.returncode} without its figures")
    return result_from_json(json.loads(out.read_text()))


def result_from_json(doc: dict) -> Result:
    names = {f.name for f in Result.__dataclass_fields__.values()}  # type: ignore[attr-defined]
    result = Result(**{k: v for k, v in doc.items() if k in names and k != "kills"})
    result.kills = [Kill(**k) for k in doc.get("kills", [])]
    return result


def _run_lane(lane: Lane, work: Path, reference: Optional[Path], say, options: dict) -> Result:
    environ, extra = dict(os.environ), dict(EXTRA_ENV)
    harness = None
    common = dict(seed=lane.seed, kills=lane.faults, work=work, reference=reference, say=say, kinds=lane.kinds)
    try:
        if lane.net:
            from skyspot.executors.local.netns import Hosts

            with Hosts(2) as hosts:
                net_options = {k: v for k, v in options.items() if k not in ("store", "wipe")}
                harness = NetHarness(hosts=hosts, **common, **net_options)
                return harness.run()
        harness = Harness(**common, **options)
        return harness.run()
    finally:
        if harness is not None and harness.s3 is not None:
            harness.s3.stop()
        if not lane.net:  # one node lane's S3 server set these: the others run on
            os.environ.clear()
            os.environ.update(environ)
            EXTRA_ENV.clear()
            EXTRA_ENV.update(extra)


SUMMED = (
    "starts", "resumes", "resumes_from_store", "lost_steps", "lost_committed", "corrupt_seen", "incomplete_seen",
    "orphans", "durable_uploads", "wipes", "durable_verified", "durable_corrupt", "rolled_back", "stale_refused",
    "steps_compared",
)  # fmt: skip


def merge(results: list[Result], plan: list[Lane], seed: int, kills: int, kinds: tuple[str, ...], work: Path) -> Result:
    """One result of every lane's: counts summed, faults and violations (named by lane) together; the run
    ends well only if every lane's does."""
    first = results[0]
    out = Result(seed, kills, first.steps, first.every_steps, first.keep, any(r.store for r in results), work=str(work))
    out.kinds, out.wipe = list(kinds), any(r.wipe for r in results)
    for lane, r in zip(plan, results):
        out.lanes.append(
            f"{lane.name} (seed {lane.seed}, {len(r.kills)} faults of {','.join(lane.kinds)}, "
            f"{'bitwise' if r.final_equal else 'NOT bitwise'}, {r.seconds:.0f} s)"
        )
    return _joined(out, [(lane.name, r) for lane, r in zip(plan, results)])


def _joined(out: Result, named: list[tuple[str, Result]]) -> Result:
    """`out` with every named result added: counts summed, faults and violations (named) together; it ends
    well only if every one does (lanes into a run, parts into a plan)."""
    for name, r in named:
        for count in SUMMED:
            setattr(out, count, getattr(out, count) + getattr(r, count))
        out.kills += r.kills
        out.violations += [f"{name}: {v}" for v in r.violations]
    results = [r for _, r in named]
    out.final_equal = all(r.final_equal for r in results)
    out.stopped_early = any(r.stopped_early for r in results)
    codes = [r.final_code for r in results]
    out.final_code = None if None in codes else next((c for c in codes if c), 0)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock; printed)")
    parser.add_argument(
        "--faults", "--kills", dest="kills", type=int, default=12, help="faults before the last, uninterrupted start"
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"'all' or a comma-separated list of {', '.join(ALL_KINDS)} (default: {','.join(KINDS)})",
    )
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: max(24, kills + 8))")
    parser.add_argument("--every", type=int, default=1, help="checkpoint.every_steps (default 1)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoint.keep (default 3)")
    parser.add_argument("--store", action="store_true", help="also upload to a local-directory store")
    parser.add_argument(
        "--wipe",
        action="store_true",
        help="every kill also wipes the node's local disk: resumes come from the store alone (implies --store)",
    )
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a new temporary one)")
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="run dir of an uninterrupted run with the same train.steps (default: run one first)",
    )
    parser.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="lanes side by side (each its own run and seed, one reference): N of the node kinds and N of "
        "the network kinds (default 1). Each lane's start is CPU-bound: on 2 cores, 2 made 17.6 s a fault, "
        "3 made 22 s (docs/reliability.md)",
    )
    parser.add_argument(
        "--stop-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give no start begun after this many seconds a fault: every lane's run then finishes uninterrupted "
        "and is compared as ever (a soak sized by the time at hand; the summary says how many faults were made)",
    )
    parser.add_argument(
        "--part",
        default=None,
        metavar="K/N",
        help="run part K of N of the plan: the lanes whose index is K-1 modulo N (--lanes N or more), against a "
        "reference of the whole plan's length; for a soak longer than the machine is held (docs/reliability.md)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="PART_JSON",
        help="join the --json files of parts 1..N of one plan (one commit, equal references) into the whole "
        "plan's figures and exit as the whole would; runs nothing",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)  # a lane's --stop-after
    parser.add_argument("--lane", default=None, help=argparse.SUPPRESS)  # run() starts each lane so
    args = parser.parse_args(argv)
    if args.merge:
        try:
            docs = [json.loads(path.read_text()) for path in args.merge]
            result = merge_parts(docs)
        except (OSError, ValueError) as err:  # json.JSONDecodeError and PartsError are ValueErrors
            parser.error(f"--merge: {err}")
        except (KeyError, TypeError, AttributeError) as err:  # a document of another shape
            parser.error(f"--merge: not a part result of this harness ({type(err).__name__}: {err})")
        return report(result, args.json)
    try:
        part = parse_part(args.part) if args.part else None
    except ValueError as err:
        parser.error(str(err))
    kinds = ALL_KINDS if args.kinds == "all" else tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(ALL_KINDS)}")
    if args.kills < 0:
        parser.error("--faults must be 0 or more")
    if args.lanes < 1:
        parser.error("--lanes must be 1 or more")
    if args.reference is not None and not (args.reference / "final" / "model.safetensors").is_file():
        parser.error(f"--reference {args.reference}: no final/model.safetensors (an uninterrupted run's directory)")
    if args.stop_after is not None and not (0 <= args.stop_after < math.inf):
        parser.error("--stop-after must be a number of seconds, 0 or more")
    if any(k in NET_KINDS for k in kinds):
        from skyspot.executors.local.netns import unavailable_reason

        if reason := unavailable_reason():
            parser.error(f"--kinds {','.join(k for k in kinds if k in NET_KINDS)}: hosts of their own: {reason}")
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    if part:
        try:
            lanes_of_part(lane_plan(seed, args.kills, kinds, args.lanes), *part)
        except ValueError as err:
            parser.error(f"--part: {err}")
    print(f"seed {seed}", flush=True)
    per_lane = max((lane.faults for lane in lane_plan(seed, args.kills, kinds, args.lanes)), default=0)
    # A fault that trains on after it (ROOMY, network) needs steps left; the others one step each.
    steps = args.steps or max(24, (4 if set(kinds) - set(KINDS) else 1) * per_lane + 8)
    if args.lane:  # one lane of a run with lanes, in its own process: exactly the lane it was given
        lane = Lane(args.lane, seed, args.kills, kinds, args.lane.startswith("net"))
        options = dict(
            steps=args.steps, every=args.every, keep=args.keep, store=args.store, wipe=args.wipe, stop_at=args.stop_at
        )
        result = _run_lane(lane, args.work, args.reference, lambda line: print(line, flush=True), options)
        args.json.write_text(json.dumps(asdict(result)) + "\n")
        return 0 if result.ok else 1
    result = run(
        seed,
        args.kills,
        steps,
        args.every,
        args.keep,
        args.work,
        args.reference,
        args.store,
        wipe=args.wipe,
        kinds=kinds,
        lanes=args.lanes,
        stop_after=args.stop_after,
        part=part,
    )
    return report(result, args.json)


def report(result: Result, json_path: Optional[Path]) -> int:
    """The figures: JSON (with --json), violations, lanes, the per-kind table, the summary; the exit code."""
    if json_path:
        json_path.write_text(
            json.dumps({**asdict(result), "per_kind": result.per_kind(), "ok": result.ok}, indent=2) + "\n"
        )
    for line in result.violations:
        print(f"VIOLATION: {line}", flush=True)
    for line in result.lanes:
        print(f"lane {line}", flush=True)
    print(result.table(), flush=True)
    print(result.summary(), flush=True)
    print(f"work dir: {result.work}", flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
