"""The checkpoint manager: when to save, where, what to resume from, what to keep.

    ckpt = CheckpointManager(run_dir, placement, recipe, run_id=..., attempt=..., events=..., comm=...)
    point = ckpt.find()                 # before the model exists: the newest checkpoint valid on every node
    ckpt.attach(engine)                 # from now on saves go through our snapshot engine
    state = ckpt.load(point)            # DeepSpeed state + RNG + data position, or None for a fresh start
    ckpt.save(step, "interval", state)  # blocks only for the in-memory snapshot
    ckpt.poll()                         # at each step: report finished writes (events)
    ckpt.save(step, "emergency", state, blocking=True)
    ckpt.close()

Policy (private): interval checkpoints every checkpoint.every_steps and/or every_seconds
(the time check is the node leader's; the loop votes so every rank agrees); retention keeps the
newest checkpoint.keep committed checkpoints, never the newest one, never one being written,
and only what every `can_delete` hook allows (the uploader vetoes ones not yet durable).

Resume rules:
- every start calls find(): no flag is needed, none can start over silently;
- a directory without a valid marker or with a file that disagrees with the manifest is not a
  checkpoint: it is skipped with a one-line warning and the previous one is used; `latest` is
  advisory and never read;
- a node "has" a step when its local copy is valid or the resume source (the store) holds it
  durable; the newest step every node has wins. A node lacking it locally downloads its own part
  (in parallel, verified); a missing or corrupt file there makes that node drop the step, with a
  one-line warning, and the ranks agree again on an older one;
- when the run has committed checkpoints but none is usable, find() raises CheckpointError
  (exit 3) rather than starting over; directories that were never committed (a write cut short)
  alone do not count, and training starts from step 0 with a warning; when the store could not
  be listed and no node has a local checkpoint, find() raises StoreError (exit 1) rather than
  start over beside progress it cannot see;
- `--fresh` moves everything aside first (rundir.move_aside) and says so.

Hooks for the store tier (uploader.py), all optional:
    ckpt.on_committed.append(fn(step, path))    called on each node leader once a step is committed
                                                on every node (from the writer thread: keep it quick)
    ckpt.can_delete.append(fn(step) -> bool)    retention asks before deleting a committed checkpoint
    ckpt.resume_source = source                 see ResumeSource (durable.StoreTier)
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from skyspot.errors import CheckpointError, StoreError
from skyspot.trainer import manifest as mf
from skyspot.trainer.files import fsync_dir
from skyspot.trainer.rundir import checkpoints_dir

TRAINER_STATE = "trainer_state_rank_{rank}.pt"
DEFAULT_AUTO_SECONDS = 1800.0


class ResumeSource(Protocol):
    """Somewhere else checkpoints may be (the run's store). The same answer on every rank."""

    name: str

    def steps(self) -> Optional[list[int]]:
        """Steps this source holds durable; None when it could not be asked (unreachable)."""

    def fetch(self, step: int, checkpoints_dir: Path) -> None:
        """Materialise this node's `checkpoints_dir/step_<N>/` (files, manifest, marker last), or raise.
        Called on node leaders; the result is then validated like any local checkpoint."""


@dataclass
class ResumePoint:
    step: int
    path: Path
    source: str
    manifest: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


@dataclass
class TrainState:
    """What the loop's position is; saved in the manifest and per rank (with the RNG states)."""

    step: int
    samples: int
    tokens: int
    data: dict[str, Any]


@dataclass
class Restored:
    state: TrainState
    load_seconds: float
    bytes: int


@dataclass
class Choice:
    step: Optional[int]
    warnings: list[str]
    problem: Optional[str] = None
    """Why nothing can be resumed although checkpoints exist (raise: exit 3)."""


def choose(views: list[list[mf.Verdict]], remote: Optional[list[set[int]]] = None,
           remote_failed: tuple[str, ...] = ()) -> Choice:
    """The newest step every node has (one list of local verdicts per node). Pure.

    A node has a step when its local copy is valid or `remote[node]` (steps the store offers that
    node) holds it. `remote_failed` names store checkpoints that turned out unusable: like corrupt
    local ones, they mean the run had checkpoints, so finding none is a problem, not a fresh start.
    """
    if not views:
        return Choice(None, [])
    remote = remote if remote is not None else [set() for _ in views]
    valid_sets = [{v.step for v in view if v.state == "valid"} | set(offered) for view, offered in zip(views, remote)]
    common = set.intersection(*valid_sets)
    step = max(common) if common else None
    warnings = []
    for node, view in enumerate(views):
        for v in view:
            if (step is None or v.step > step) and v.state != "valid":
                warnings.append(f"skipping {v}")
            elif step is not None and v.step > step:
                warnings.append(f"skipping {v.path.name}: valid here but not on every node")
    if step is not None:
        return Choice(step, warnings)
    corrupt = [v for view in views for v in view if v.state == "corrupt"]
    partial = [v for view in views for v in view if v.state == "valid"]
    if corrupt or partial or remote_failed:
        what = "; ".join([str(v) for v in (corrupt or partial)[:3]] + list(remote_failed[:2]))
        return Choice(None, warnings, f"the run has committed checkpoints but none is usable ({what})")
    return Choice(None, warnings)


def retention_victims(verdicts: list[mf.Verdict], keep: int, newest: int,
                      can_delete: Callable[[int], bool]) -> list[Path]:
    """What retention removes after `newest` was committed. Pure.

    Keeps the newest `keep` committed checkpoints up to `newest` (always including `newest`),
    anything newer than `newest`, and any committed checkpoint a hook refuses to let go; removes
    older committed ones and older directories that never committed (leftovers of a cut write).
    """
    older = [v for v in verdicts if v.step <= newest]
    committed = sorted((v for v in older if v.state == "valid"), key=lambda v: v.step, reverse=True)
    kept = {v.step for v in committed[:max(1, keep)]} | {newest}
    victims = []
    for v in older:
        if v.step in kept:
            continue
        if v.state == "valid" and not can_delete(v.step):
            continue
        if v.state != "valid" and v.step == newest:
            continue
        victims.append(v.path)
    return victims


def remove_checkpoint_dir(path: Path) -> None:
    """Unlink the marker first, so a kill mid-delete leaves an 'incomplete' directory, never a 'corrupt' one."""
    try:
        (path / mf.MARKER).unlink()
        fsync_dir(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    def __init__(self, run_dir: Path, placement, recipe, *, run_id: str, attempt: int, events, comm,
                 warn: Callable[[str], None]):
        self.run_dir = Path(run_dir)
        self.root = checkpoints_dir(self.run_dir)
        self.placement = placement
        self.recipe = recipe
        self.run_id = run_id
        self.attempt = attempt
        self.events = events  # EventWriter; run-level events only on global rank 0
        self.comm = comm
        self.warn = warn
        self.on_committed: list[Callable[[int, Path], None]] = []
        self.can_delete: list[Callable[[int], bool]] = []
        self.resume_source: Optional[ResumeSource] = None
        self.engine = None
        self.writer = None
        self.last_committed: Optional[int] = None
        self.every_steps = recipe.checkpoint.every_steps
        self.every_seconds = self._every_seconds(recipe)
        self._last_save_time = time.monotonic()
        if placement.is_node_leader:
            self.root.mkdir(parents=True, exist_ok=True)

    def _every_seconds(self, recipe) -> Optional[float]:
        value = recipe.checkpoint.every_seconds
        if value != "auto":
            return value
        plan = None
        try:
            from skyspot.planning import initial_plan

            cloud = self.placement.where.get("cloud")
            plan = initial_plan(recipe, cloud) if cloud in ("aws", "gcp", "azure") else None
        except Exception as err:  # planning is advice; never stop training over it
            self.warn(f"checkpoint.every_seconds=auto: no plan ({err}); using {DEFAULT_AUTO_SECONDS:.0f} s")
        seconds = float(plan.every_seconds) if plan is not None else DEFAULT_AUTO_SECONDS
        if self.placement.is_global_zero and self.events is not None:
            fields = plan.event_fields() if plan is not None else {
                "every_seconds": seconds, "inputs": {"note": "auto without a plan: default"}}
            self.events.emit("interval_plan", **fields)
        return seconds

    def _emit(self, type: str, **fields: Any) -> None:
        if self.placement.is_global_zero and self.events is not None:
            self.events.emit(type, **fields)

    # ------------------------------------------------------------------ resume
    def find(self) -> Optional[ResumePoint]:
        """Agree with every rank on the checkpoint to resume from (collective). None: fresh start.

        Each node leader offers its local verdicts and the store's durable steps it has not found
        unusable; the newest step every node has is chosen; a node that lacks it locally (or whose
        copy fails its checksums) fetches its own part from the store. If any node fails, it drops
        that step and the ranks choose again, so every round offers strictly less.
        """
        source = self.resume_source
        offered = source.steps() if source is not None else []
        unreachable = source is not None and offered is None
        remote = set(offered or [])
        verified: dict[int, mf.Verdict] = {}  # full-checksum verdicts, kept across rounds
        bad_remote: set[int] = set()
        failed: list[str] = []
        notes: list[str] = []
        while True:
            mine = None
            if self.placement.is_node_leader:
                scanned = [verified.get(v.step, v) for v in mf.scan(self.root, stop_at_first_valid=True)]
                mine = (scanned, sorted(remote - bad_remote), list(failed))
            views = [view for view in self.comm.all_gather_object(mine) if view is not None]
            all_failed = tuple(line for view in views for line in view[2])
            choice = choose([view[0] for view in views], [set(view[1]) for view in views], all_failed)
            if choice.step is None:
                for line in choice.warnings + notes:
                    self._say(line)
                if choice.problem:
                    raise CheckpointError(
                        f"{self.root}: {choice.problem}. Nothing was started over. Repair or move the "
                        "checkpoints, or pass --fresh to start from step 0 (old checkpoints are moved aside, not deleted)")
                if unreachable:
                    raise StoreError(
                        f"cannot list the store {source.name}, and no node has a local checkpoint: nothing was "
                        "started, since starting over could overwrite the run's progress there. Start again "
                        "when the store is reachable")
                return None
            ok, fetched, note = True, False, None
            if self.placement.is_node_leader:
                ok, fetched, note = self._have(choice.step, mine[0], remote - bad_remote, verified)
                if not ok and choice.step in remote and choice.step not in bad_remote and fetched:
                    bad_remote.add(choice.step)
                    failed.append(note)
                fetched = fetched and ok
            outcome = self.comm.all_gather_object((ok, fetched, note))
            notes += [n for _, _, n in outcome if n]
            if all(o for o, _, _ in outcome):
                for line in choice.warnings + notes:
                    self._say(line)
                path = self.root / mf.step_dir_name(choice.step)
                verdict = mf.inspect(path, verify_checksums=False)
                source_name = "store" if any(f for _, f, _ in outcome) else "local"
                return ResumePoint(choice.step, path, source_name, verdict.manifest or {}, choice.warnings + notes)

    def _have(self, step: int, scanned: list[mf.Verdict], remote: set[int],
              verified: dict[int, mf.Verdict]) -> tuple[bool, bool, Optional[str]]:
        """Node leader: make sure `step` is valid here. (ok, tried the store, one-line note)."""
        local = next((v for v in scanned if v.step == step), None)
        if local is not None and local.state == "valid" and not local.verified:
            local = verified[step] = mf.inspect(local.path, verify_checksums=True)
        if local is not None and local.state == "valid":
            return True, False, None
        if local is not None:
            verified[step] = local
        if step not in remote:
            return False, False, None
        try:
            self.resume_source.fetch(step, self.root)
            verdict = mf.inspect(self.root / mf.step_dir_name(step), verify_checksums=False)
            if verdict.state != "valid":
                raise CheckpointError(f"checkpoint step_{step} from {self.resume_source.name}: {verdict}")
        except (CheckpointError, StoreError, OSError) as err:
            return False, True, f"node {self.placement.node_rank}: {err}; falling back to an earlier checkpoint"
        verified[step] = verdict
        prefix = f"node {self.placement.node_rank}: local step_{step} {local.state}; " if local is not None else ""
        return True, True, (prefix + f"downloaded step_{step} from {self.resume_source.name}") if prefix else None

    def _say(self, line: str) -> None:
        if self.placement.is_global_zero:
            self.warn(line)

    def attach(self, engine) -> None:
        """Route DeepSpeed's checkpoint files through our snapshot engine and background writer."""
        from skyspot.trainer.snapshot import BufferPool, SnapshotCheckpointEngine
        from skyspot.trainer.writer import CheckpointWriter

        self.engine = engine
        self.writer = CheckpointWriter(rank=self.placement.rank, node_rank=self.placement.node_rank,
                                       is_node_leader=self.placement.is_node_leader,
                                       exchange=self.comm.writer_exchange, on_committed=self.on_committed,
                                       after_commit=self._retain, warn=self.warn)
        engine.checkpoint_engine = SnapshotCheckpointEngine(self.writer, BufferPool())

    def load(self, point: Optional[ResumePoint]) -> Optional[Restored]:
        """Restore the engine, RNG states and data position from `point` (collective)."""
        import torch

        from skyspot.trainer.determinism import replay_adam_bias_correction, restore_rng
        from skyspot.trainer.engine import basic_optimizer

        if point is None:
            return None
        start = time.monotonic()
        m = point.manifest
        if m.get("world_size") != self.placement.world_size:
            raise CheckpointError(
                f"{point.path} was written by {m.get('world_size')} ranks, this start has {self.placement.world_size}: "
                "ZeRO-3 shards cannot be re-partitioned on load. Start with the same number of nodes and ranks "
                "(or convert it with DeepSpeed's universal checkpoint tools)")
        path, _ = self.engine.load_checkpoint(str(self.root), tag=point.path.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True, load_module_strict=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {point.path}")
        own = torch.load(point.path / TRAINER_STATE.format(rank=self.placement.rank), map_location="cpu",
                         weights_only=False)
        restore_rng(own["rng"])
        replay_adam_bias_correction(basic_optimizer(self.engine))
        state = TrainState(int(m["step"]), int(m["samples"]), int(m["tokens"]), dict(m["data"]))
        if self.engine.global_steps != state.step:
            raise CheckpointError(f"{point.path}: DeepSpeed restored global step {self.engine.global_steps}, "
                                  f"the manifest says {state.step}")
        self.last_committed = state.step
        self._last_save_time = time.monotonic()
        seconds = time.monotonic() - start
        self._emit("resume", step=state.step, checkpoint=str(point.path), source=point.source,
                   load_seconds=round(seconds, 6), bytes=m.get("bytes"), samples=state.samples,
                   tokens=state.tokens, skipped=point.warnings)
        return Restored(state, seconds, int(m.get("bytes") or 0))

    # ------------------------------------------------------------------ save
    def time_due(self) -> bool:
        """This process's view of the time interval (the loop takes the leader's through the vote)."""
        return self.every_seconds is not None and time.monotonic() - self._last_save_time >= self.every_seconds

    def due(self, step: int, requested: bool) -> bool:
        if step == self.last_committed:
            return False
        return requested or (self.every_steps is not None and step % self.every_steps == 0)

    def save(self, step: int, kind: str, state: TrainState, *, blocking: bool = False):
        """Checkpoint `step` (collective). Blocks for the snapshot; with blocking, until committed."""
        from skyspot.trainer.determinism import capture_rng

        previous = self.writer.wait()  # one writer per directory; and the buffers are free again
        self.poll()
        if previous is not None and previous.committed and previous.step == step:
            return previous  # e.g. an emergency right after an interval save of the same step
        start = time.monotonic()
        directory = self.root / mf.step_dir_name(step)
        self._emit("checkpoint_begin", step=step, kind=kind)
        if self.placement.is_node_leader and directory.exists():
            # A leftover of a cut write or a step not valid on every node: never write into it.
            stale = self.root / f".stale-{directory.name}-{self.attempt}-{os.getpid()}"
            os.replace(directory, stale)
            remove_checkpoint_dir(stale)
        self.comm.barrier()
        self.writer.begin(step, kind, directory)
        try:
            self.engine.save_checkpoint(str(self.root), tag=directory.name, client_state={}, save_latest=False)
            self.writer.add(directory / TRAINER_STATE.format(rank=self.placement.rank),
                            {"rng": capture_rng(), "step": step, "samples": state.samples,
                             "tokens": state.tokens, "data": state.data})
        except BaseException:
            self.writer.abandon()
            raise
        blocked = time.monotonic() - start
        self.writer.submit(self._manifest(step, kind, state), blocked)
        self._last_save_time = time.monotonic()
        if blocking:
            result = self.writer.wait()
            self.poll()
            return result
        return None

    def _manifest(self, step: int, kind: str, state: TrainState) -> dict[str, Any]:
        import deepspeed
        import torch

        p = self.placement
        return {"format": mf.FORMAT, "step": step, "kind": kind, "run_id": self.run_id, "attempt": self.attempt,
                "created_at": time.time(), "samples": state.samples, "tokens": state.tokens, "data": state.data,
                "world_size": p.world_size, "num_nodes": p.num_nodes, "node_rank": p.node_rank,
                "recipe_fingerprint": self.recipe.fingerprint(), "recipe": self.recipe.model_dump(mode="json"),
                "deepspeed_tag": mf.step_dir_name(step),
                "rank_state_files": TRAINER_STATE.format(rank="<R>"),
                "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__}}

    def poll(self):
        """Report a finished background write (events); returns its result once."""
        if self.writer is None:
            return None
        result = self.writer.poll()
        if result is None:
            return None
        if result.committed:
            self.last_committed = result.step
            self._emit("checkpoint_end", step=result.step, kind=result.kind,
                       blocked_seconds=round(result.blocked_seconds, 6), write_seconds=round(result.write_seconds, 6),
                       bytes=result.bytes, path=str(result.path), committed_at=result.committed_at)
        else:
            self._emit("checkpoint_failed", step=result.step, kind=result.kind, error=result.error)
            self._say(f"checkpoint step_{result.step} failed: {result.error}")
        return result

    def wait(self):
        result = self.writer.wait() if self.writer is not None else None
        self.poll()
        return result

    def close(self, timeout: Optional[float] = None) -> None:
        if self.writer is not None:
            self.writer.close(timeout)
            self.poll()

    def _retain(self, step: int, path: Path) -> None:
        """Writer thread, node leader, after `step` is committed on every node."""
        verdicts = mf.scan(self.root, verify_checksums=False)
        allow = lambda s: all(hook(s) for hook in self.can_delete)  # noqa: E731
        for victim in retention_victims(verdicts, self.recipe.checkpoint.keep, step, allow):
            remove_checkpoint_dir(victim)
