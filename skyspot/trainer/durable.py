"""The durable tier as the trainer uses it: the run's store at start, as a resume source, and at exit.

    tier = StoreTier(uri, run_id, placement)   # every rank; no network yet
    probe = tier.probe(fresh=...)              # global rank 0 at start: attempt counter, listing, run.json
    tier.adopt(probe)                          # every rank, with rank 0's probe
    CheckpointManager(..., resume_source=tier) # steps() from the probe; plan_fetch() + fetch_share(): this node's
                                               # part, each local rank downloading its share
    uploader = tier.uploader(events, ...)      # node leaders: checkpoint hooks, events sync

The store's run root is `<store>/<run_id>/` (rundir.py and remote.py for the layout). What happens
when the store misbehaves at start:

    no credentials, access denied, no bucket    UsageError: one line, exit 2, nothing started
    unreachable or throttling (after retries)   one warning; resume from local checkpoints;
                                                with none on any node, StoreError: exit 1, since
                                                starting over could overwrite the run's progress
    --fresh while the store holds checkpoints   UsageError: the store's are never deleted

During training, store trouble never stops the loop: the uploader retries in the background.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from skyspot.clouds import NOTICE_WINDOWS_S
from skyspot.errors import StoreError
from skyspot.storage import Store, TransientStoreError, join_key, open_store, with_retries

# Notice windows per cloud: skyspot/clouds/ (sources there and in docs/notices.md). A SIGTERM that
# came without a notice gets its cloud's window; elsewhere (local runs, unknown clouds) 30 s.
DEFAULT_WINDOW_S = 30.0
# Kept free before the deadline to record the exit and sync the event files.
EXIT_MARGIN_S = 3.0
# How long the start retries a store that does not answer before giving up on it (about 30 s).
START_RETRIES = dict(attempts=6, base_delay=1.0, max_delay=8.0)
# How long a completed run waits for its final checkpoint to become durable before exiting.
FINAL_UPLOAD_S = 900.0


def emergency_deadline(
    notice_deadline: Optional[float],
    first_seen: Optional[float],
    cloud: Optional[str],
    environ: Mapping[str, str] = os.environ,
    now: Optional[float] = None,
) -> float:
    """The wall-clock time by which the emergency checkpoint's upload must be done. Pure.

    A notice's own deadline; else the first signal plus the cloud's notice window (30 s when the
    cloud is unknown); never later than torchrun's own SIGKILL (TORCH_ELASTIC_SHUTDOWN_TIMEOUT after
    the signal); minus EXIT_MARGIN_S to record the exit and sync the events.
    """
    seen = first_seen or (time.time() if now is None else now)
    deadline = notice_deadline or seen + NOTICE_WINDOWS_S.get(cloud or "", DEFAULT_WINDOW_S)
    raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip()
    try:
        shutdown = float(raw) if raw else None
    except ValueError:
        shutdown = None
    if shutdown and shutdown > 0:
        deadline = min(deadline, seen + shutdown)
    return deadline - EXIT_MARGIN_S


def _env_seconds(name: str, default: float, environ: Mapping[str, str] = os.environ) -> float:
    raw = environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return value if value > 0 else default


@dataclass
class Probe:
    """What global rank 0 learnt from the store at start (sent to every rank)."""

    attempt: Optional[int] = None
    """The store's attempt counter after counting this start; None when the store did not answer."""
    remote_steps: Optional[list[int]] = None
    """Durable checkpoints in the store; None when unknown (unreachable)."""
    run_json: Optional[bytes] = None
    """The store's run.json, when it has one."""
    epoch: Optional[int] = None
    """The epoch this attempt took in the run's fence (fence.py); None for a restart in place (it keeps its
    attempt's) or when the store did not answer (the first commit joins the fence's)."""
    warning: Optional[str] = None
    usage_error: Optional[str] = None


class StoreTier:
    """The run's store, seen from one trainer process (a ResumeSource for the checkpoint manager)."""

    def __init__(
        self, uri: str, run_id: str, placement, *, warn: Callable[[str], None] = print, store: Optional[Store] = None
    ):
        self.store = store if store is not None else open_store(uri)
        self.uri = self.store.uri
        self.name = self.uri
        self.run_id = run_id
        self.placement = placement
        self.warn = warn
        self.remote_steps: Optional[list[int]] = None
        self.epoch: Optional[int] = None
        """This attempt's epoch in the run's fence (fence.py), once known."""

    # ------------------------------------------------------------------ start (global rank 0)
    def probe(self, *, fresh: bool = False, retries: Optional[dict] = None, count: bool = True) -> Probe:
        """Ask the store what a start needs: is the run there, which checkpoints are durable, which attempt this is
        (`count`: False for a restart in place, which continues its attempt: restart.py)."""
        from skyspot.trainer.rundir import RUN_JSON, next_attempt_in_store
        from skyspot.trainer.fence import Fence
        from skyspot.trainer.remote import is_durable_listing, listing, remote_checkpoints

        retries = START_RETRIES if retries is None else retries
        where = f"{self.uri}/{self.run_id}"
        try:
            steps = with_retries(lambda: remote_checkpoints(self.store, self.run_id), **retries)
            if fresh and steps:
                return Probe(
                    usage_error=(
                        f"--fresh cannot start {self.run_id!r} over: {where} holds its checkpoints "
                        f"(steps {', '.join(map(str, steps))}), and the store's are never deleted; use another "
                        "--run-name, or delete that prefix yourself"
                    )
                )
            run_json = with_retries(lambda: self.store.get_bytes(join_key(self.run_id, RUN_JSON)), **retries)
            attempt = next_attempt_in_store(self.store, self.run_id, **retries) if count else None
            epoch = None
            if count:  # a new attempt fences off every older one, then lists what it resumes from (fence.py)

                def legacy() -> dict[int, set[str]]:
                    keys_by_step = listing(self.store, self.run_id, fenced=False)
                    return {s: k for s, k in keys_by_step.items() if is_durable_listing(k)}

                epoch = Fence(self.store, self.run_id).take(legacy)
                steps = with_retries(lambda: remote_checkpoints(self.store, self.run_id), **retries)
        except TransientStoreError as err:
            return Probe(
                warning=(
                    f"cannot reach the store {where} ({err}); resuming from local checkpoints if "
                    "there are any; uploads retry in the background"
                )
            )
        except StoreError as err:
            return Probe(usage_error=f"store {where}: {err}")
        return Probe(attempt=attempt, remote_steps=steps, run_json=run_json, epoch=epoch)

    def adopt(self, probe: Probe) -> None:
        """Every rank: take rank 0's view of the store."""
        self.remote_steps = None if probe.remote_steps is None else list(probe.remote_steps)
        self.epoch = probe.epoch if probe.epoch is not None else self.epoch

    # ------------------------------------------------------------------ resume source
    def steps(self) -> Optional[list[int]]:
        """Durable checkpoints in the store as of the start; None when the store did not answer."""
        return self.remote_steps

    def plan_fetch(self, step: int):
        """This node's part of `step` as the store's marker and manifest describe it (remote.PartPlan), for a
        fetch the node's ranks share (checkpoint.py): node 0's when the step was written by fewer nodes."""
        from skyspot.trainer.remote import plan_part

        return plan_part(self.store, self.run_id, step, node_rank=self.placement.node_rank, any_node=True)

    def fetch_share(self, plan, names: list[str], directory: Path) -> None:
        """Download and verify `names` of a planned part into `directory` (this rank's share)."""
        from skyspot.trainer.remote import fetch_files

        # Every local rank downloads at once: fewer threads each, about 32 streams per node in all.
        workers = max(2, 32 // max(1, self.placement.local_world_size))
        fetch_files(self.store, plan, names, directory, max_workers=workers)

    def fetch_part(self, step: int, node_rank: int, directory: Path) -> Path:
        """Node `node_rank`'s part of `step` into `directory` (verified): another node's files, for a
        resume at another world size (reshard.gather)."""
        from skyspot.trainer.remote import download_checkpoint

        return download_checkpoint(self.store, self.run_id, step, directory, node_rank=node_rank)

    def stream_target(self, environ: Mapping[str, str] = os.environ) -> Optional["StreamTarget"]:
        """Where this rank's checkpoint files stream while they are written (writer.py); None when
        SKYSPOT_STREAM_UPLOADS=0 (then the node's uploader sends committed files after the commit)."""
        if environ.get("SKYSPOT_STREAM_UPLOADS", "").strip().lower() in ("0", "false", "no", "off"):
            return None
        return StreamTarget(self.store, self.run_id, self.remote_steps or [], self.epoch)

    def read_events(self) -> list[dict]:
        """Every event the store holds for this run (earlier attempts', synced by node leaders)."""
        from skyspot.events import read_events_store

        return read_events_store(self.store, self.run_id).events

    # ------------------------------------------------------------------ uploads (node leaders)
    def uploader(
        self, events, run_dir: Path, keep: int, epoch: Optional[int] = None, environ: Mapping[str, str] = os.environ
    ):
        """The node's uploader: committed checkpoints, this node's event files, retention.

        SKYSPOT_STORE_RETRY_MAX_SECONDS caps the backoff between tries during an outage (60 s);
        SKYSPOT_EVENTS_SYNC_SECONDS is how often event files are synced (30 s).
        """
        from skyspot.events import EVENTS_DIR
        from skyspot.trainer.fence import Fence
        from skyspot.trainer.uploader import Uploader

        uploader = Uploader(
            self.store,
            self.run_id,
            events,
            keep=keep,
            warn=self.warn,
            node_rank=self.placement.node_rank,
            num_nodes=self.placement.num_nodes,
            retry_max_delay=_env_seconds("SKYSPOT_STORE_RETRY_MAX_SECONDS", 60.0, environ),
            events_dir=Path(run_dir) / EVENTS_DIR,
            events_every=_env_seconds("SKYSPOT_EVENTS_SYNC_SECONDS", 30.0, environ),
            fence=Fence(self.store, self.run_id, epoch if epoch is not None else self.epoch),
        )
        uploader.note_durable(self.remote_steps or [])
        return uploader


class StreamTarget:
    """Opens one stream per checkpoint file: `<run>/checkpoints/step_<N>/<file>` in the store.

    Steps the store already held durable at start are never streamed over (their markers would
    vouch for files being replaced); the uploader's path handles those, marker first.
    """

    def __init__(self, store: Store, run_id: str, durable_at_start: list[int], epoch: Optional[int] = None):
        self.store = store
        self.run_id = run_id
        self.epoch = epoch
        self._skip = set(durable_at_start)

    def enabled(self, step: int) -> bool:
        """Stream this step's files: not one durable at start, nor one the fence already records (a newer
        attempt's), nor any once a newer attempt holds the store (one read of the fence per checkpoint;
        an unreachable store: the streams fail on their own and the uploader takes over)."""
        if step in self._skip or not hasattr(self.store, "open_stream"):
            return False
        from skyspot.trainer import fence

        try:
            doc = fence.read(self.store, self.run_id, retry=False)
        except StoreError:
            return True
        return doc is None or (str(step) not in doc["commits"] and (self.epoch is None or doc["epoch"] <= self.epoch))

    def open(self, step: int, rel: str, source: Path):
        from skyspot.trainer.remote import checkpoint_prefix

        return self.store.open_stream(join_key(checkpoint_prefix(self.run_id, step), rel), source=source)


def restore_run_json(run_dir: Path, probe: Probe, fresh: bool) -> None:
    """A fresh run directory on a new machine takes the store's run.json (the run's first start)."""
    from skyspot.trainer.files import atomic_write_bytes
    from skyspot.trainer.rundir import RUN_JSON

    path = Path(run_dir) / RUN_JSON
    if probe.run_json and not fresh and not path.exists():
        try:
            json.loads(probe.run_json)
        except ValueError:
            return
        atomic_write_bytes(path, probe.run_json)
