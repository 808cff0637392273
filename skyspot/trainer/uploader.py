"""The upload worker: committed local checkpoints to the run's store, in the background.

The trainer saves to a local fast tier and hands each committed checkpoint to one
`Uploader` per node (the caller runs it on local rank 0); the training loop never waits
on the network:

    uploader = Uploader(open_store(store_uri), run_id, events, keep=3, warn=log.warning,
                        node_rank=0, num_nodes=1)
    uploader.submit(step, run_dir / "checkpoints" / f"step_{step}")   # returns at once
    ...
    uploader.set_deadline(notice_deadline)     # emergency path: later submissions race it
    uploader.flush_until(notice_deadline)      # make the newest one durable if it fits
    uploader.close()

Local checkpoint contract (written by the checkpoint module): `step_<N>/` holds the files
this node's ranks wrote, `manifest.json` with `"files": {relpath: {"size", "sha256"}}`,
and the `COMMITTED` marker written last (manifest.py). Remote layout: remote.py, which also
lists and downloads; beside the checkpoints this worker syncs `events/*.jsonl` (sync_events), with
them the dashboards' local files (`sync_also`: tensorboard/, trainer/metrics/), and `run.json`,
`final/...` (sync_small, put_tree).

Each node uploads its own files, then its manifest, then its marker. A remote checkpoint
is *durable* only when the markers of all NODES nodes exist (the marker's name carries
NODES, so one listing decides), and each marker is uploaded after that node's other
files, so a durable checkpoint never stands for incomplete files. When a newer
checkpoint arrives while an older one is uploading, the older one is abandoned at the
next file boundary (unless only its manifest and marker are left) and never gets a
marker; the retention pass deletes its partial files once a newer one is durable. So the
checkpoint interval must exceed the upload time, or nothing ever becomes durable;
`upload_end` events with `durable: false` make that visible. An emergency checkpoint
submitted after `set_deadline` abandons the upload in flight only when that is what lets
it become durable before the deadline (see `keep_in_flight`).

Streamed checkpoints (writer.py): the ranks' writers stream the data files to the store while
writing them. The writer announces such a step (`expect_streams`) before submitting it, and
reports which files arrived (`streams_done`); the job waits for that report, uploads from
disk only the files that did not arrive, then the manifest and the marker. The writer decides
whether streams are abandoned for a newer checkpoint, so a job waiting for its streams is
never superseded here.

One concept although long: one background worker's state (the queue, newest-wins, the
deadline race, streamed files, retries through outages, retention) under one lock, which
has to be read together to be trusted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from skyspot.errors import StoreError
from skyspot.events import EVENTS_DIR, EventWriter
from skyspot.storage import Store, TransientStoreError, join_key, with_retries
from skyspot.trainer import manifest as mf
from skyspot.trainer.fence import Fence, Stale
from skyspot.trainer.remote import checkpoint_prefix, durable_steps, listing

log = logging.getLogger(__name__)
T = TypeVar("T")


def keep_in_flight(
    current_left_bytes: int, new_bytes: int, bytes_per_second: float | None, seconds_left: float
) -> bool:
    """Emergency submission: should the upload in flight go on (the new one waiting behind it)? Pure.

    Newest-wins abandons the older upload. Before a deadline that can lose both: the older one
    would have finished, the newer one cannot. So the older one is kept when it can finish in
    time and either the new one cannot make it anyway, or both fit one after the other. With
    nothing measured yet, newest wins.
    """
    if not bytes_per_second or bytes_per_second <= 0:
        return False
    current_fits = current_left_bytes / bytes_per_second <= seconds_left
    new_fits = new_bytes / bytes_per_second <= seconds_left
    both_fit = (current_left_bytes + new_bytes) / bytes_per_second <= seconds_left
    return current_fits and (both_fit or not new_fits)


class _Abandoned(Exception):
    """Raised inside an upload to stop it at a file boundary (superseded, failed elsewhere, closing)."""


@dataclass
class _Job:
    step: int
    local_dir: Path
    stop_reason: str | None = None
    total_bytes: int = 0
    done_bytes: int = 0
    started: float | None = None
    supersedes: bool = True
    """False for an emergency submission that waits for the upload in flight instead of abandoning it."""
    streamed_bytes: int = 0
    stream_seconds: float = 0.0


class Uploader:
    """Uploads this node's committed local checkpoints in a background thread; keeps the newest `keep` remotely.

    `submit` only enqueues. Only the newest submission waits: a newer one replaces a
    queued older one and abandons one in flight. Transient store trouble (unreachable,
    throttled) is retried with backoff for as long as it lasts, with one `warn` per
    outage and a log line on recovery. Remote retention (node 0 only) deletes only
    durable checkpoints beyond the newest `keep` (markers first), and partial leftovers
    older than the newest durable one; local checkpoints are never touched here (the
    checkpoint module asks `can_delete_local` first).
    """

    def __init__(
        self,
        store: Store,
        run_prefix: str,
        events: EventWriter | None = None,
        keep: int | None = 3,
        warn: Callable[[str], None] = log.warning,
        *,
        node_rank: int = 0,
        num_nodes: int = 1,
        max_workers: int = 8,
        retry_base_delay: float = 1.0,
        retry_max_delay: float = 60.0,
        events_dir: str | os.PathLike | None = None,
        events_every: float = 30.0,
        fence: Fence | None = None,
    ):
        """`keep=None` keeps every durable checkpoint. With `events_dir`, the node's event files
        are synced every `events_every` seconds (and at close), so the bucket alone tells the
        run's story; with several nodes that loop also refreshes which checkpoints are durable.
        `fence`: this attempt's hold on the store (fence.py); without one, the first commit takes an epoch."""
        if keep is not None and keep < 1:
            raise ValueError("keep must be at least 1 (or None to keep every checkpoint)")
        if not 0 <= node_rank < num_nodes:
            raise ValueError(f"node_rank {node_rank} is not in 0..{num_nodes - 1}")
        self.store = store
        self.run_prefix = run_prefix.strip("/")
        self.events = events
        self.keep = keep
        self.warn = warn
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.max_workers = max_workers
        self.retry_base_delay = retry_base_delay
        self.retry_max_delay = retry_max_delay
        self.fence = fence if fence is not None else Fence(store, self.run_prefix)
        self._stale_told = False

        self._cv = threading.Condition()
        self._pending: _Job | None = None
        self._current: _Job | None = None
        self._last_submitted: int | None = None
        self._uploaded: set[int] = set()  # steps whose marker for this node is remote
        self._durable: set[int] = set()  # steps with every node's marker (as far as known)
        self._given_up: dict[int, str] = {}  # step -> why it will never become durable here
        self._closing = False
        self._deadline: float | None = None
        self._throughput_bps: float | None = None
        self._streams: dict[int, dict | None] = {}  # step -> the writers' report (None: still streaming)

        self._outage_lock = threading.Lock()
        self._outage_since: float | None = None

        self._sync_lock = threading.Lock()
        self._synced: dict[str, tuple[int, int]] = {}
        self._also: list[tuple[Path, str]] = []  # (local dir, key prefix) synced with the event files
        self.on_uploaded: list[Callable[[int, float], None]] = []
        """Called with (step, wall time) once this node's part of a step, marker included, is in the
        store (from the uploader's thread; keep it quick): the trainer's save-time predictor."""

        self._thread = threading.Thread(target=self._run, name="skyspot-uploader", daemon=True)
        self._thread.start()
        self._events_dir = Path(events_dir) if events_dir is not None else None
        self._events_stop = threading.Event()
        self._events_thread = None
        if self._events_dir is not None:
            self._events_thread = threading.Thread(
                target=self._sync_events_loop, args=(events_every,), name="skyspot-events-sync", daemon=True
            )
            self._events_thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, step: int, local_dir: str | os.PathLike) -> None:
        """Queue a committed local checkpoint for upload; returns at once."""
        job = _Job(step, Path(local_dir))
        with self._cv:
            if self._closing:
                raise RuntimeError("Uploader.submit after close()")
            current, deadline = self._current, self._deadline
            streaming = current is not None and self._streams.get(current.step, False) is None
        if streaming:
            job.supersedes = False  # the writer decides whether those streams give way (writer._keep_streams)
        elif deadline is not None and current is not None and current.step < step and current.stop_reason is None:
            job.supersedes = not self._keep_current(current, job, deadline)
        with self._cv:
            if self._pending is not None and self._pending.step != step:
                self._give_up(self._pending.step, f"superseded by step {step} before it started", 0, 0.0)
            self._pending = job
            self._last_submitted = step
            self._given_up.pop(step, None)
            self._cv.notify_all()

    def expect_streams(self, step: int) -> None:
        """The writers are streaming this step's files (call before submitting it)."""
        with self._cv:
            self._streams[step] = None

    def streams_done(
        self,
        step: int,
        ok: set[str],
        *,
        abandoned: str | None = None,
        failed: dict[str, str] | None = None,
        streamed_bytes: int = 0,
        seconds: float = 0.0,
    ) -> None:
        """The writers' report: the files of this node that are whole in the store, or why they gave up."""
        with self._cv:
            if step in self._streams:
                self._streams[step] = {
                    "ok": set(ok),
                    "abandoned": abandoned,
                    "failed": dict(failed or {}),
                    "bytes": streamed_bytes,
                    "seconds": seconds,
                }
                self._cv.notify_all()

    def set_deadline(self, deadline_ts: float | None) -> None:
        """From now on, submissions race this wall-clock deadline (a preemption's): see `keep_in_flight`."""
        with self._cv:
            self._deadline = deadline_ts

    def note_durable(self, steps) -> None:
        """Steps known durable from elsewhere (the resume listing), so local retention may let them go."""
        with self._cv:
            self._durable.update(steps)

    def is_durable(self, step: int) -> bool:
        """Whether every node's remote marker for the checkpoint exists (as far as this uploader knows)."""
        with self._cv:
            return step in self._durable

    @property
    def stale(self) -> Stale | None:
        """Set once a newer attempt holds the run's store: nothing of this attempt's is written any more."""
        return self.fence.stale

    def is_uploaded(self, step: int) -> bool:
        """Whether this node's part of the checkpoint is in the store, marker included."""
        with self._cv:
            return step in self._uploaded

    def can_delete_local(self, step: int) -> bool:
        """Local retention's veto: a local checkpoint may go once it, or a newer one, is durable.

        A newer durable checkpoint makes an older one that never got there (abandoned for a newer
        one, or cut off by an outage) useless as a resume point; keeping it would only fill the
        disk after every outage. Answered from memory: it runs on the writer thread.
        """
        with self._cv:
            return step in self._durable or any(s > step for s in self._durable)

    def durable_steps(self) -> list[int]:
        """Steps known durable remotely: uploaded here (one node), or seen at the last listing."""
        with self._cv:
            return sorted(self._durable)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or uploading; return whether that happened in time."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and self._current is None, timeout)

    def flush_until(self, deadline_ts: float) -> bool:
        """Emergency path: wait for this node's part of the newest submitted checkpoint to be uploaded by `deadline_ts`.

        Returns False early when it cannot make it: it was abandoned or failed, or the
        bytes left at the throughput measured so far would not fit before the deadline
        (`deadline_ts` is wall-clock, as in a preemption notice). An older upload kept in
        flight (see `keep_in_flight`) is waited for meanwhile. The uploads go on in the
        background either way. With several nodes, the checkpoint is durable when every
        node's call returned True.
        """
        with self._cv:
            target = self._last_submitted
            if target is None:
                return True
            while True:
                if target in self._uploaded:
                    return True
                if target in self._given_up:
                    return False
                left = deadline_ts - time.time()
                if left <= 0 or not self._fits(target, left):
                    return False
                self._cv.wait(min(left, 0.25))

    def close(self, timeout: float | None = None, join_timeout: float | None = None) -> bool:
        """Wait up to `timeout` (None: until done) for queued uploads, then stop.

        What is still in flight then is abandoned at the next file boundary (waiting at most
        `join_timeout` for it). The event files are synced one last time. Returns whether
        this node's part of the newest submitted checkpoint is in the store.
        """
        self.wait(timeout)
        with self._cv:
            self._closing = True
            if self._current is not None and self._current.stop_reason is None:
                self._current.stop_reason = "uploader closed"
            self._cv.notify_all()
        self._thread.join(join_timeout)
        if self._events_thread is not None:
            self._events_stop.set()
            self._events_thread.join(join_timeout)
            self.sync_events(self._events_dir)
        with self._cv:
            return self._last_submitted is None or self._last_submitted in self._uploaded

    def sync_small(self, local_path: str | os.PathLike, key: str) -> bool:
        """Upload one small file (run.json, an events file) to `<run_prefix>/<key>`.

        Blocking, with a few quick retries; never raises a StoreError: a failure is
        warned about and reported as False, so training goes on.
        """
        data = Path(local_path).read_bytes()
        if not self._still_held(key):
            return False
        return self._blocking(lambda: self.store.put_bytes(join_key(self.run_prefix, key), data), attempts=3)

    def put_tree(self, local_dir: str | os.PathLike, key_prefix: str, timeout: float | None = None) -> bool:
        """Upload every file under `local_dir` to `<run_prefix>/<key_prefix>/` (e.g. the final model).

        Blocking, with a few retries, for at most `timeout` seconds (None: until done; past it the
        upload is left to a daemon thread that dies with the process, and this says so); never raises
        a StoreError (warns and returns False).
        """
        root = Path(local_dir)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

        def upload() -> bool:
            if not self._still_held(f"{key_prefix}/"):
                return False
            return self._blocking(
                lambda: self.store.upload_dir(root, join_key(self.run_prefix, key_prefix), files, self.max_workers),
                attempts=5,
            )

        if timeout is None:
            return upload()
        done: list[bool] = []
        thread = threading.Thread(target=lambda: done.append(upload()), name="skyspot-put-tree", daemon=True)
        thread.start()
        thread.join(timeout)
        if not done:
            self.warn(f"{key_prefix}/ is not in the store after {timeout:g} s; it is in {root}")
            return False
        return done[0]

    def _still_held(self, what: str) -> bool:
        """Whether this attempt still holds the store (one read of the fence; an unreachable store counts as
        held: the write that follows fails on its own). A stale attempt writes nothing more."""
        try:
            self.fence.check(what)
        except Stale as stale:
            self._on_stale(stale)
            return False
        except StoreError:
            pass
        return True

    def _blocking(self, fn: Callable[[], object], attempts: int) -> bool:
        """One blocking store call with a few retries; a StoreError is warned about and reported as False."""
        try:
            with_retries(fn, attempts=attempts, base_delay=self.retry_base_delay, max_delay=self.retry_max_delay)
        except StoreError as error:
            self._warn_outage(error)
            return False
        self._note_success()
        return True

    def sync_events(self, local_events_dir: str | os.PathLike) -> int:
        """Upload the `*.jsonl` files of a local events dir that changed since the last sync.

        Files are read whole and written as whole objects (writers keep appending; a
        torn last line is skipped by readers). Returns how many files were uploaded.
        """
        uploaded = 0
        if not self._still_held("the events sync"):
            return 0
        with self._sync_lock:
            files = [(path, join_key(EVENTS_DIR, path.name)) for path in sorted(Path(local_events_dir).glob("*.jsonl"))]
            files += [
                (path, join_key(prefix, rel))
                for directory, prefix in self._also
                for path, rel in _regular_files(directory)
            ]
            for path, key in files:
                try:
                    stat = path.stat()
                    signature = (stat.st_size, stat.st_mtime_ns)
                    if self._synced.get(key) == signature:
                        continue
                    data = path.read_bytes()
                except OSError:
                    continue
                try:
                    self.store.put_bytes(join_key(self.run_prefix, key), data)
                except StoreError as error:
                    self._warn_outage(error)
                    return uploaded
                self._synced[key] = signature
                uploaded += 1
        if uploaded:
            self._note_success()
        return uploaded

    def sync_also(self, local_dir: str | os.PathLike, key_prefix: str) -> None:
        """Sync every regular file under `local_dir` to `<run_prefix>/<key_prefix>/` whenever the event
        files are (a dashboard's own files: trainer/metrics/). Links are never followed."""
        with self._sync_lock:
            self._also.append((Path(local_dir), key_prefix))

    def refresh_durable(self) -> list[int]:
        """List the store and update which checkpoints are durable (every node's marker there)."""
        durable = durable_steps(listing(self.store, self.run_prefix))
        with self._cv:
            self._durable = set(durable)
            self._cv.notify_all()
        return durable

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closing)
                if self._closing:
                    if self._pending is not None:
                        self._give_up(self._pending.step, "uploader closed before it started", 0, 0.0)
                        self._pending = None
                    self._cv.notify_all()
                    return
                job, self._pending = self._pending, None
                self._current = job
            try:
                self._upload(job)
            except Exception as error:  # a bug must not kill the thread silently
                log.exception("checkpoint upload of step %s crashed", job.step)
                with self._cv:
                    self._give_up(job.step, f"{type(error).__name__}: {error}", 0, 0.0)
            finally:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()

    def _wait_streams(self, job: _Job) -> set[str]:
        """The files the writers streamed for `job`'s step (empty when it was not streamed). Raises
        _Abandoned when the writers gave up on it for a newer checkpoint, or the job was stopped."""
        with self._cv:
            if job.step not in self._streams:
                return set()
            self._cv.wait_for(
                lambda: self._streams.get(job.step) is not None or job.stop_reason is not None or self._closing
            )
            report = self._streams.pop(job.step, None)
        if report is None:
            raise _Abandoned(job.stop_reason or "uploader closed")
        if report["abandoned"]:
            raise _Abandoned(report["abandoned"])
        for rel, error in sorted(report["failed"].items())[:1]:
            log.info("%s did not stream (%s); uploading it from the local copy", rel, error)
        job.streamed_bytes, job.stream_seconds = report["bytes"], report["seconds"]
        return report["ok"]

    def _upload(self, job: _Job) -> None:
        start = time.monotonic()
        job.started = start
        prefix = checkpoint_prefix(self.run_prefix, job.step)
        try:
            files = _local_files(job.local_dir)
        except (OSError, ValueError) as error:
            with self._cv:
                self._streams.pop(job.step, None)
            self._fail(job, f"local checkpoint not uploadable: {error}", start)
            return
        job.total_bytes = sum(files.values())
        try:
            streamed = self._wait_streams(job)
        except _Abandoned as stop:
            self._fail(job, str(stop), start, warn=False)
            return
        job.done_bytes = sum(size for rel, size in files.items() if rel in streamed)
        manifest_key = join_key(prefix, mf.node_manifest_name(self.node_rank))
        marker_key = join_key(prefix, mf.node_marker_name(self.node_rank, self.num_nodes))
        uploaded: list[str] = []
        try:
            existing = self._retry(job, lambda: self.store.list(prefix + "/"))
            mine = [
                k
                for k in existing
                if (m := mf.NODE_MARKER.match(k.rsplit("/", 1)[-1])) and int(m.group(1)) == self.node_rank
            ]
            if mine:
                # An earlier attempt got this node's part there. The same checkpoint (a resume from
                # it) needs no upload; a different one replaces it, and the old marker must not
                # vouch for half-replaced files, so it goes first.
                remote = self._retry(job, lambda: self.store.get_bytes(manifest_key))
                if marker_key in mine and remote == (job.local_dir / mf.MANIFEST).read_bytes():
                    self._commit(job)
                    self._succeed(job, start, 0)
                    return
                self._retry(job, lambda: self.fence.check(f"replacing step {job.step}'s part"))
                self._retry(job, lambda: self.store.delete(mine))
            self._retry(job, lambda: self.fence.check(f"the upload of step {job.step}"))
            self._put_all(job, prefix, [rel for rel in files if rel not in streamed], uploaded)
            # Two small files from done: finished even if a newer checkpoint just arrived.
            for name, key in ((mf.MANIFEST, manifest_key), (mf.MARKER, marker_key)):
                self._put_one(
                    job, job.local_dir / name, key, os.path.getsize(job.local_dir / name), uploaded, check=False
                )
            self._commit(job)
        except Stale as stale:  # a newer attempt holds the store: its marker (if written) never counts
            self._on_stale(stale)
            self._fail(job, str(stale), start, warn=False)
            return
        except _Abandoned as stop:
            # No cleanup here: the partial files carry no marker, so they never count, and the
            # retention pass after the next durable upload deletes them. That keeps the path of
            # the newer (often emergency) upload, and of close(), free of extra store calls.
            self._fail(job, str(stop), start, warn=False)
            return
        except StoreError as error:
            self._cleanup(prefix, uploaded)
            self._fail(job, str(error), start)
            return
        except OSError as error:  # the local checkpoint vanished or is unreadable mid-upload
            self._cleanup(prefix, uploaded)
            self._fail(job, f"local checkpoint not readable: {error}", start)
            return

        self._succeed(job, start, job.total_bytes)

    def _commit(self, job: _Job) -> None:
        """The node's marker is in the store: the fence records the part, and from then on it counts."""
        self._retry(job, lambda: self.fence.commit(job.step, self.node_rank, self.num_nodes))

    def _on_stale(self, stale: Stale) -> None:
        """Once: say it (an event, a warning) and leave the create-only record the status reads."""
        with self._cv:
            told, self._stale_told = self._stale_told, True
            self._cv.notify_all()
        if told:
            return
        self.warn(f"{stale}; this attempt stops (a newer one carries the run on)")
        fields = {"epoch": stale.epoch, "newer": stale.newer, "what": stale.what, "node": self.node_rank}
        if self.events is not None:
            event = self.events.emit("stale_attempt", **fields)
        else:
            event = {"ts": time.time(), "run_id": self.run_prefix, "type": "stale_attempt", **fields}
        self.fence.leave_record(self.node_rank, event)

    def _succeed(self, job: _Job, start: float, nbytes: int) -> None:
        seconds = time.monotonic() - start
        uploaded_at = time.time()
        if nbytes > 0:
            for hook in list(self.on_uploaded):
                try:
                    hook(job.step, uploaded_at)
                except Exception:  # a hook must never break uploads
                    log.exception("on_uploaded hook failed")
        with self._cv:
            self._uploaded.add(job.step)
            if self.num_nodes == 1:
                self._durable.add(job.step)
            if seconds > 0 and nbytes > job.streamed_bytes:  # streamed bytes went before the job began
                self._throughput_bps = (nbytes - job.streamed_bytes) / seconds
            self._cv.notify_all()
        self._apply_retention()
        with self._cv:
            durable = job.step in self._durable
        self._emit(
            job.step,
            nbytes,
            seconds,
            durable=durable,
            error=None,
            streamed_bytes=job.streamed_bytes,
            stream_seconds=job.stream_seconds,
        )

    def _put_all(self, job: _Job, prefix: str, names: list[str], uploaded: list[str]) -> None:
        """Upload the data files in parallel; the first failure stops the others at a file boundary."""
        if not names:
            return
        sizes = {name: os.path.getsize(job.local_dir / name) for name in names}
        # Largest first, so one big shard does not start last and stretch the upload.
        names = sorted(names, key=lambda n: -sizes[n])
        with ThreadPoolExecutor(
            max_workers=max(1, min(self.max_workers, len(names))), thread_name_prefix="skyspot-upload"
        ) as pool:
            futures = [
                pool.submit(self._put_one, job, job.local_dir / name, join_key(prefix, name), sizes[name], uploaded)
                for name in names
            ]
            try:
                wait_futures(futures, return_when=FIRST_EXCEPTION)
                for future in futures:
                    if future.done():
                        future.result()
            except BaseException as error:
                with self._cv:
                    if job.stop_reason is None:
                        job.stop_reason = f"stopped after an error: {error}"
                    self._cv.notify_all()
                for future in futures:
                    future.cancel()
                raise
            for future in futures:
                future.result()

    def _put_one(
        self, job: _Job, local_path: Path, key: str, size: int, uploaded: list[str], check: bool = True
    ) -> None:
        if check:
            self._check_stop(job)
        with self._cv:
            uploaded.append(key)
        self._retry(job, lambda: self.store.put_file(local_path, key))
        with self._cv:
            job.done_bytes += size

    # ------------------------------------------------------------------ retries and outages

    def _superseded_by(self, job: _Job) -> int | None:
        """The newer step that stops `job` (caller holds the lock)."""
        pending = self._pending
        if pending is not None and pending.step > job.step and pending.supersedes:
            return pending.step
        return None

    def _check_stop(self, job: _Job) -> None:
        with self._cv:
            newer = self._superseded_by(job)
            if job.stop_reason is None and newer is not None:
                job.stop_reason = f"superseded by step {newer}"
            if job.stop_reason is not None:
                raise _Abandoned(job.stop_reason)

    def _retry(self, job: _Job, fn: Callable[[], T]) -> T:
        """Run one store call, retrying transient errors until it works or the job is stopped."""

        def sleep(delay: float) -> None:
            # Wait on the condition, not time.sleep, so a newer submission or close() cuts the wait short.
            with self._cv:
                self._cv.wait_for(
                    lambda: job.stop_reason is not None or self._closing or self._superseded_by(job) is not None, delay
                )
            self._check_stop(job)

        result = with_retries(
            fn,
            attempts=None,
            base_delay=self.retry_base_delay,
            max_delay=self.retry_max_delay,
            on_retry=lambda _attempt, error, _delay: self._warn_outage(error),
            sleep=sleep,
        )
        self._note_success()
        return result

    def _warn_outage(self, error: BaseException) -> None:
        with self._outage_lock:
            if self._outage_since is not None:
                return
            self._outage_since = time.monotonic()
        what = "cannot reach the store" if isinstance(error, TransientStoreError) else "store error"
        self.warn(f"{what} ({error}); uploads retry with backoff while training continues")

    def _note_success(self) -> None:
        with self._outage_lock:
            since, self._outage_since = self._outage_since, None
        if since is not None:
            log.warning(
                "store %s reachable again after %.0f s; uploads resumed", self.store.uri, time.monotonic() - since
            )

    # ------------------------------------------------------------------ bookkeeping

    def _rate(self, job: _Job | None) -> float | None:
        """Bytes per second: the last finished upload's, else the one in flight's so far."""
        if self._throughput_bps:
            return self._throughput_bps
        if job is not None and job.started is not None and job.done_bytes > 0:
            elapsed = time.monotonic() - job.started
            return job.done_bytes / elapsed if elapsed > 0 else None
        return None

    def _keep_current(self, current: _Job, job: _Job, deadline: float) -> bool:
        try:
            new_bytes = sum(_local_files(job.local_dir).values())
        except (OSError, ValueError):
            return False
        with self._cv:
            if self._current is not current or current.stop_reason is not None:
                return False
            left_bytes = max(0, current.total_bytes - current.done_bytes)
            rate = self._rate(current)
        keep = keep_in_flight(left_bytes, new_bytes, rate, deadline - time.time())
        if keep:
            self.warn(
                f"checkpoint step {job.step} is queued behind step {current.step}'s upload: "
                f"{left_bytes} bytes left of that one fit before the deadline, and abandoning it "
                "would not make the newer one durable in time"
            )
        return keep

    def _fits(self, target: int, seconds_left: float) -> bool:
        current = self._current
        if current is None or current.step != target or self._streams.get(target, False) is None:
            return True  # not started yet, behind a kept upload, or streaming: keep trying until the deadline
        # Only a finished upload's throughput: the one in flight advances a file at a time, and its
        # small files finish first, so its progress so far says little about its rate.
        rate = self._throughput_bps
        if not rate:
            return True  # nothing measured yet
        return (current.total_bytes - current.done_bytes) / rate <= seconds_left

    def _fail(self, job: _Job, reason: str, start: float, warn: bool = True) -> None:
        seconds = time.monotonic() - start
        with self._cv:
            self._give_up(job.step, reason, job.done_bytes, seconds)
        if warn:
            self.warn(f"checkpoint step {job.step} was not uploaded: {reason}")

    def _give_up(self, step: int, reason: str, done_bytes: int, seconds: float) -> None:
        """Record that a step will not become durable here (caller holds the lock)."""
        self._given_up[step] = reason
        self._streams.pop(step, None)
        self._cv.notify_all()
        self._emit(step, done_bytes, seconds, durable=False, error=reason)

    def _emit(
        self,
        step: int,
        nbytes: int,
        seconds: float,
        durable: bool,
        error: str | None,
        streamed_bytes: int = 0,
        stream_seconds: float = 0.0,
    ) -> None:
        if self.events is None:
            return
        extra = {"streamed_bytes": streamed_bytes, "stream_seconds": round(stream_seconds, 3)} if streamed_bytes else {}
        try:
            self.events.emit(
                "upload_end",
                step=step,
                bytes=nbytes,
                seconds=round(seconds, 3),
                throughput_bps=round(nbytes / seconds) if seconds > 0 else None,
                durable=durable,
                error=error,
                node=self.node_rank,
                nodes=self.num_nodes,
                **extra,
            )
        except (OSError, ValueError):
            log.exception("cannot write upload_end event")

    def _cleanup(self, prefix: str, uploaded: list[str]) -> None:
        """Best effort: delete a failed upload's files. Without a marker they never count anyway."""
        keys = [k for k in uploaded if not mf.NODE_MARKER.match(k.rsplit("/", 1)[-1])]
        try:
            self.store.delete(keys)
        except StoreError as error:
            log.info("left partial upload under %s/%s (no marker, ignored): %s", self.store.uri, prefix, error)

    def _apply_retention(self) -> None:
        """Learn which checkpoints are durable; on node 0, keep the newest `keep` of them and drop older leftovers.

        Markers go first, so an interrupted deletion leaves files that no longer count,
        never a marker over missing files. Only node 0 deletes, so nodes never race each
        other over the same keys.
        """
        try:
            keys_by_step = listing(self.store, self.run_prefix)
            durable = durable_steps(keys_by_step)
            doomed = durable[: -self.keep] if self.keep is not None and self.node_rank == 0 else []
            with self._cv:
                self._durable = set(durable)
            self.fence.forget(doomed)  # out of the fence first: from then on no reader counts them
            for step in doomed:
                with self._cv:
                    self._durable.discard(step)
                keys = sorted(keys_by_step[step])
                self.store.delete([k for k in keys if mf.is_marker(k.rsplit("/", 1)[-1])])
                self.store.delete([k for k in keys if not mf.is_marker(k.rsplit("/", 1)[-1])])
            if durable and self.node_rank == 0:
                for step, keys in keys_by_step.items():
                    if step < durable[-1] and step not in durable:
                        self.store.delete(sorted(keys))
        except Stale as stale:
            self._on_stale(stale)
        except StoreError as error:
            log.warning("checkpoint retention skipped, will retry after the next upload: %s", error)

    def _sync_events_loop(self, every: float) -> None:
        while not self._events_stop.wait(every):
            try:
                self.sync_events(self._events_dir)
                if self.num_nodes > 1:
                    self.refresh_durable()  # another node may have finished its part since
            except StoreError as error:
                self._warn_outage(error)
            except Exception:
                log.exception("events sync failed")


def _regular_files(directory: Path) -> list[tuple[Path, str]]:
    """(path, relative posix path) of every regular file under `directory`, no link followed (W&B keeps
    a `latest-run` link among its files)."""
    found = []
    for root, dirs, names in os.walk(directory):  # os.walk follows no directory link by default
        for name in sorted(names):
            path = Path(root) / name
            if not path.is_symlink() and path.is_file():
                found.append((path, path.relative_to(directory).as_posix()))
    return sorted(found, key=lambda item: item[1])


def _local_files(local_dir: Path) -> dict[str, int]:
    """The data files a committed local checkpoint lists, with sizes checked against its manifest."""
    if not (local_dir / mf.MARKER).is_file():
        raise ValueError(f"{local_dir} has no {mf.MARKER} marker")
    try:
        files = mf.file_table(json.loads((local_dir / mf.MANIFEST).read_text(encoding="utf-8")))
    except ValueError as error:
        raise ValueError(f"{local_dir / mf.MANIFEST}: {error}") from None
    sizes = {}
    for rel, meta in files.items():
        size = (local_dir / rel).stat().st_size
        if size != meta["size"]:
            raise ValueError(f"{rel} is {size} bytes, the manifest says {meta['size']}")
        sizes[rel] = size
    return sizes
