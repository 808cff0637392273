"""The background checkpoint writer and the commit protocol.

One writer thread per rank. The loop hands it a batch (one checkpoint's snapshotted files) and
goes on training; the thread then, for that batch:

1. writes each file with torch.save (DeepSpeed's format), hashing the bytes as they are written,
   then fsyncs the file, and finally the directory;
2. exchanges (all ranks, on a dedicated gloo group so it never interleaves with the training
   loop's collectives) each rank's file list and any error: a barrier that proves every rank's
   files are on disk;
3. on the node leader (local rank 0) only, if no rank failed: writes manifest.json (this node's
   files with size and sha256), fsyncs it, then writes the COMMITTED marker and fsyncs it and the
   directory. The marker is the commit point; nothing is ever written to the directory after it;
4. exchanges again, so every rank learns whether every node committed. Only then is the step
   "globally committed": the leader updates the advisory `latest`, runs the on_committed hooks
   (the uploader) and retention.

A kill at any point leaves either a directory without a marker (not a checkpoint) or a complete
one. A signal only sets a flag (preemption.py), so a write in progress always finishes. The
manager never submits a batch while one is in flight, so there is one writer per directory.

With a store (`streams`, durable.StreamTarget), each file also streams to the store while it is
written: the bytes torch.save produces go to the local file, the sha256 and the store's upload in
one pass, large chunks straight from the snapshot buffers (no copy), many parts in flight per
file. The local commit does not wait for the network. After it, the writer thread waits for its
streams (the upload phase), then a third exchange tells each node leader which of its node's
files reached the store, and the leader hands that to the uploader (`stream_sink`), which
uploads what is missing from disk, then the node's manifest and marker. The snapshot buffers are
reused by the next checkpoint only after `begin` released the streams still reading them (what is
left is then read back from the local files). A newer checkpoint abandons streams still running
(newest wins), unless an emergency checkpoint with a deadline is better served by letting them
finish (uploader.keep_in_flight).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from skyspot.events import CheckpointKind
from skyspot.storage import StoreError
from skyspot.trainer.faults import fault_point
from skyspot.trainer.files import atomic_write_bytes, fsync_dir
from skyspot.trainer.manifest import LATEST, new_digest, remove_checkpoint_dir, write_manifest, write_marker

Exchange = Callable[[Any], list]


@dataclass
class WriteResult:
    step: int
    kind: str
    path: Path
    committed: bool
    error: Optional[str] = None
    bytes: int = 0
    """Bytes this node wrote for the checkpoint (the leader's manifest total; 0 on failure)."""
    blocked_seconds: float = 0.0
    write_seconds: float = 0.0
    committed_at: Optional[float] = None


@dataclass
class _Batch:
    step: int
    kind: str
    directory: Path
    files: list[tuple[Path, Any]] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    blocked_seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[WriteResult] = None
    stream: bool = False
    """Stream this checkpoint's files to the store while writing them."""
    streams: dict[str, Any] = field(default_factory=dict)
    """rel path -> storage.StreamUpload, for this rank's files."""
    stream_errors: dict[str, str] = field(default_factory=dict)
    started: float = 0.0


# How long the upload phase waits for a checkpoint's streams at most (well under the writer
# group's 30 min collective timeout, comm.py); what did not make it is uploaded from disk.
STREAM_WAIT_S = 20 * 60.0


class _HashingFile:
    """A write-only file object that hashes and counts what passes through it, and hands the same
    bytes to a stream to the store (when there is one): one pass over the data for all three."""

    def __init__(self, f, on_first_write: Callable[[], None], stream=None):
        self._f = f
        self.sha = new_digest()
        self.size = 0
        self._first = on_first_write
        self._stream = stream
        self.error: Optional[BaseException] = None

    def write(self, data) -> int:
        try:
            view = memoryview(data).cast("B")
            self._f.write(view)
            self.sha.update(view)
            if self._stream is not None:
                self._stream.write(view)  # never blocks: kept as a view, or copied if small
            self.size += len(view)
            if self._first is not None:
                first, self._first = self._first, None
                first()
            return len(view)
        except BaseException as err:
            self.error = err  # torch.save's zip writer would report it as "unexpected pos ..."
            raise

    def flush(self) -> None:
        self._f.flush()


class CheckpointWriter:
    def __init__(
        self,
        *,
        rank: int,
        node_rank: int,
        is_node_leader: bool,
        exchange: Exchange,
        on_committed: Optional[list[Callable[[int, Path], None]]] = None,
        after_commit: Optional[Callable[[int, Path], None]] = None,
        warn: Callable[[str], None] = print,
        streams=None,
    ):
        self.rank = rank
        self.node_rank = node_rank
        self.is_node_leader = is_node_leader
        self.exchange = exchange
        self.on_committed = on_committed if on_committed is not None else []
        self.after_commit = after_commit
        self.warn = warn
        self.streams = streams
        """durable.StreamTarget (every rank, with a store): where files stream while written."""
        self.stream_sink = None
        """The node's uploader (node leaders): told which files arrived by stream."""
        self._deadline: Optional[float] = None
        self._streaming: list[_Batch] = []  # batches whose streams may still read snapshot memory
        self._stream_lock = threading.Lock()
        self._warned_stream = False
        self._open: Optional[_Batch] = None
        self._last: Optional[_Batch] = None
        self._reported: Optional[_Batch] = None
        self._queue: "queue.Queue[Optional[_Batch]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"skyspot-ckpt-writer-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread
    def begin(self, step: int, kind: str, directory: Path) -> None:
        if self.in_flight:
            raise RuntimeError("a checkpoint is still being written; wait() first")
        self._release_streams()  # the snapshot about to be taken reuses the buffers they read
        self._open = _Batch(step, kind, Path(directory), stream=self.streams is not None and self.streams.enabled(step))

    def set_deadline(self, deadline_ts: Optional[float]) -> None:
        """Streams still running at this wall-clock time are abandoned (a preemption's upload deadline)."""
        self._deadline = deadline_ts

    def _release_streams(self) -> None:
        with self._stream_lock:
            for batch in self._streaming:
                for stream in batch.streams.values():
                    stream.release()
            self._streaming = [b for b in self._streaming if not all(s.done for s in b.streams.values())]

    def add(self, path: Path, obj: Any) -> None:
        if self._open is None:
            raise RuntimeError("CheckpointWriter.add outside a checkpoint (begin() first)")
        self._open.files.append((Path(path), obj))

    def submit(self, manifest: dict[str, Any], blocked_seconds: float) -> None:
        batch, self._open = self._open, None
        if batch is None:
            raise RuntimeError("submit() without begin()")
        batch.manifest = manifest
        batch.blocked_seconds = blocked_seconds
        self._last = batch
        self._queue.put(batch)

    def abandon(self) -> None:
        """Drop an open batch whose snapshot failed (nothing was queued)."""
        self._open = None

    @property
    def in_flight(self) -> bool:
        return self._last is not None and not self._last.done.is_set()

    def wait(self, timeout: Optional[float] = None) -> Optional[WriteResult]:
        """Block until the last submitted checkpoint is committed or failed; its result."""
        batch = self._last
        if batch is None:
            return None
        if not batch.done.wait(timeout):
            return None
        return batch.result

    def poll(self) -> Optional[WriteResult]:
        """The result of the last checkpoint once it is done, exactly once."""
        batch = self._last
        if batch is None or batch is self._reported or not batch.done.is_set():
            return None
        self._reported = batch
        return batch.result

    def close(self, timeout: Optional[float] = None) -> None:
        self.wait(timeout)
        self._queue.put(None)
        self._thread.join(timeout=1.0 if timeout is not None else None)

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                batch.result = self._write(batch)
            except BaseException as err:  # never leave the loop waiting on a dead thread
                batch.result = WriteResult(
                    batch.step,
                    batch.kind,
                    batch.directory,
                    False,
                    f"{type(err).__name__}: {err}",
                    blocked_seconds=batch.blocked_seconds,
                )
            finally:
                batch.done.set()
            if batch.stream:  # decided alike on every rank: the third exchange is collective
                try:
                    self._upload_phase(batch, batch.result is not None and batch.result.committed)
                except Exception as err:  # the checkpoint is committed locally; the uploader has the disk path
                    self.warn(
                        f"checkpoint step_{batch.step}: streaming to the store failed ({type(err).__name__}: "
                        f"{err}); it is uploaded from the local copy instead"
                    )

    def _write_file(self, path: Path, obj: Any, step: int, first: bool, stream=None) -> dict[str, Any]:
        def mid_file():
            f.flush()
            os.fsync(f.fileno())
            fault_point("mid_file", step)

        with open(path, "wb") as f:
            hashing = _HashingFile(f, mid_file if first else None, stream)
            try:
                torch.save(obj, hashing)
            except Exception:
                if hashing.error is not None:
                    raise hashing.error from None
                raise
            f.flush()
            if stream is not None:
                stream.end()
            os.fsync(f.fileno())
        return {"size": hashing.size, "sha256": hashing.sha.hexdigest(), "rank": self.rank}

    def _open_stream(self, batch: _Batch, rel: str, path: Path):
        if not batch.stream:
            return None
        try:
            stream = self.streams.open(batch.step, rel, path)
        except (StoreError, OSError, ImportError) as err:
            if not self._warned_stream:
                self._warned_stream = True
                self.warn(f"cannot stream checkpoint files to the store ({err}); they are uploaded after the commit")
            batch.stream_errors[rel] = str(err)
            return None
        batch.streams[rel] = stream
        return stream

    def _write(self, batch: _Batch) -> WriteResult:
        start = time.monotonic()
        entries: dict[str, dict[str, Any]] = {}
        error = None
        batch.started = time.time()
        if batch.stream:
            with self._stream_lock:
                self._streaming.append(batch)
        try:
            fault_point("write_begin", batch.step)
            for i, (path, obj) in enumerate(batch.files):
                rel = path.relative_to(batch.directory).as_posix()
                entries[rel] = self._write_file(
                    path, obj, batch.step, first=(i == 0), stream=self._open_stream(batch, rel, path)
                )
            batch.files.clear()  # drop references; the buffers stay in the pool
            fsync_dir(batch.directory)
        except Exception as err:
            error = f"rank {self.rank}: {type(err).__name__}: {err}"
        gathered = self.exchange({"rank": self.rank, "node_rank": self.node_rank, "entries": entries, "error": error})
        errors = [g["error"] for g in gathered if g.get("error")]
        node_bytes = 0
        marker_error = None
        if not errors and self.is_node_leader:
            try:
                files: dict[str, dict[str, Any]] = {}
                for g in sorted(gathered, key=lambda g: g["rank"]):
                    if g["node_rank"] == self.node_rank:
                        files.update(g["entries"])
                node_bytes = sum(meta["size"] for meta in files.values())
                manifest = dict(
                    batch.manifest,
                    files=files,
                    bytes=node_bytes,
                    ranks=sorted({meta["rank"] for meta in files.values()}),
                    write_seconds=round(time.monotonic() - start, 6),
                    blocked_seconds=round(batch.blocked_seconds, 6),
                )
                fault_point("before_manifest", batch.step)
                manifest_sha = write_manifest(batch.directory, manifest)
                fault_point("before_marker", batch.step)
                write_marker(batch.directory, batch.step, manifest_sha)
                fault_point("after_marker", batch.step)
            except Exception as err:
                marker_error = f"node {self.node_rank}: {type(err).__name__}: {err}"
        outcome = self.exchange({"rank": self.rank, "error": marker_error})
        errors += [g["error"] for g in outcome if g.get("error")]
        write_seconds = time.monotonic() - start
        if errors:
            for stream in batch.streams.values():
                stream.abort("the checkpoint was not committed")
            batch.streams.clear()
            if self.is_node_leader:
                # It never committed on every node, and on a full disk its partial files hold the space the
                # event files and the next checkpoint need. Every rank is done with it (two exchanges).
                remove_checkpoint_dir(batch.directory)
            return WriteResult(
                batch.step,
                batch.kind,
                batch.directory,
                False,
                "; ".join(errors),
                blocked_seconds=batch.blocked_seconds,
                write_seconds=write_seconds,
            )
        result = WriteResult(
            batch.step,
            batch.kind,
            batch.directory,
            True,
            None,
            node_bytes,
            batch.blocked_seconds,
            write_seconds,
            time.time(),
        )
        if self.is_node_leader:
            self._after_global_commit(batch)
        return result

    def _after_global_commit(self, batch: _Batch) -> None:
        if batch.stream and self.stream_sink is not None:
            self.stream_sink.expect_streams(batch.step)  # before the hooks submit the step
        try:
            atomic_write_bytes(batch.directory.parent / LATEST, batch.directory.name.encode())
        except OSError as err:
            self.warn(f"could not update {batch.directory.parent / LATEST} (advisory): {err}")
        for hook in list(self.on_committed):
            try:
                hook(batch.step, batch.directory)
            except Exception as err:  # a hook (the uploader) must never break training
                self.warn(f"on_committed hook {getattr(hook, '__name__', hook)!r} failed: {err}")
        if self.after_commit is not None:
            try:
                self.after_commit(batch.step, batch.directory)
            except Exception as err:
                self.warn(f"checkpoint retention failed: {err}")

    # ------------------------------------------------------------------ upload phase (writer thread)
    def _upload_phase(self, batch: _Batch, committed: bool) -> None:
        """Wait for this rank's streams of a committed checkpoint; then every rank says which files
        arrived (third exchange, collective), and each node leader tells its uploader."""
        reason = None if committed else "the checkpoint was not committed"
        limit = time.monotonic() + STREAM_WAIT_S
        while reason is None and not all(s.done for s in batch.streams.values()):
            newer = self._queued()
            if newer is not None and not self._keep_streams(batch, newer):
                reason = f"superseded by step {newer.step}"
            elif self._deadline is not None and time.time() >= self._deadline:
                reason = "the preemption's upload deadline passed"
            elif time.monotonic() >= limit:
                reason = f"still uploading after {STREAM_WAIT_S:.0f} s"
            else:
                time.sleep(0.02)
        ok, errors = [], dict(batch.stream_errors)
        for rel, stream in batch.streams.items():
            if reason is not None and not stream.done:
                stream.abort(reason, wait=10.0)
            try:
                if stream.finish(timeout=0 if reason else None):
                    ok.append(rel)
            except StoreError as err:
                errors[rel] = str(err)
        with self._stream_lock:
            if batch in self._streaming:
                self._streaming.remove(batch)
        if not committed:
            return
        ended = max((s.finished or 0.0 for s in batch.streams.values()), default=0.0)
        mine = {
            "rank": self.rank,
            "node_rank": self.node_rank,
            "ok": ok,
            "errors": errors,
            "abandoned": reason,
            "bytes": sum(batch.streams[r].bytes for r in ok),
            "seconds": max((s.finished or s.started) - s.started for s in batch.streams.values()) if ended else 0.0,
        }
        everyone = self.exchange(mine)
        if not self.is_node_leader or self.stream_sink is None:
            return
        node = [g for g in everyone if g["node_rank"] == self.node_rank]
        abandoned = next((g["abandoned"] for g in node if g["abandoned"]), None)
        failed = {rel: err for g in node for rel, err in g["errors"].items()}
        self.stream_sink.streams_done(
            batch.step,
            {rel for g in node for rel in g["ok"]},
            abandoned=abandoned,
            failed=failed,
            streamed_bytes=sum(g["bytes"] for g in node),
            seconds=max(g["seconds"] for g in node),
        )

    def _queued(self) -> Optional[_Batch]:
        """The next checkpoint waiting for this thread, if one was submitted (not the close sentinel)."""
        with self._queue.mutex:
            return next((b for b in self._queue.queue if b is not None), None)

    def _keep_streams(self, batch: _Batch, newer: _Batch) -> bool:
        """Newest wins, except for an emergency checkpoint racing a deadline when letting this upload
        finish first is what keeps one of the two durable (uploader.keep_in_flight)."""
        from skyspot.trainer.uploader import keep_in_flight

        if newer.kind != CheckpointKind.EMERGENCY or self._deadline is None:
            return False
        elapsed = max(1e-3, time.time() - batch.started)
        sent = sum(s.sent for s in batch.streams.values())
        total = sum(s.bytes for s in batch.streams.values())
        return keep_in_flight(total - sent, total, sent / elapsed if sent else None, self._deadline - time.time())
