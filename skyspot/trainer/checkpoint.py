"""The checkpoint manager: when to save, where, what to resume from, what to keep.

    ckpt = CheckpointManager(run_dir, placement, recipe, run_id=..., attempt=..., events=..., comm=...,
                             resume_source=tier, on_committed=[uploader.submit], ...)   # hooks: below
    point = ckpt.find()                   # before the model exists: the newest checkpoint valid on every node
    state = ckpt.load(point, engine)      # saves go through our snapshot engine from now on; DeepSpeed
                                          # state + RNG + data position, or None for a fresh start
    ckpt.poll()                           # at each step: report finished writes (events, the predictor)
    ckpt.save(step, state, time_due=...)  # an interval checkpoint when the policy says it is due
    ckpt.save(step, state, kind="emergency", deadline=..., blocking=True)
    ckpt.close()

The surface is torchtitan's (save, load, wait, close) plus what the loop truly needs: `find`, since
the checkpoint decides the model's architecture and the world size's batch split before the engine
exists; `poll`, since finished writes must be reported every step, also while a notice window holds
saves back; and `interval_elapsed`, this process's view of the time interval, which the loop puts into
its one all-gather per step so every rank agrees on global rank 0's.

Policy (private): interval checkpoints every checkpoint.every_steps and/or every_seconds (a number,
or `auto`: planned by interval.py when loading, re-planned after each committed checkpoint);
retention keeps the newest checkpoint.keep committed checkpoints, never the newest one, never one
being written, and only what every `can_delete` hook allows (the uploader vetoes ones not yet durable).

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

Hooks, all optional and given at construction (the store tier's: durable.py, uploader.py):
    resume_source   see ResumeSource (durable.StoreTier)
    on_committed    fn(step, path), on each node leader once a step is committed on every node
                    (from the writer thread: keep it quick; the uploader's submit only enqueues)
    can_delete      fn(step) -> bool, asked by retention before deleting a committed checkpoint
    stream_sink     told which files the writers streamed to the store (the node's uploader)
    predictor       told when saves start and how long they took (preemption.SavePredictor)
    history         earlier attempts' events when the run directory has none (the store's), for `auto`

One concept although past 500 lines: finding, restoring, saving and retaining share the manager's
view of which steps are committed, so they stay one object (the pure rules, `choose` and
`retention_victims`, are plain functions above it).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Protocol, Sequence, Union

from skyspot.errors import CheckpointError, StoreError
from skyspot.events import CheckpointKind
from skyspot.trainer import manifest as mf
from skyspot.trainer.rundir import checkpoints_dir

if TYPE_CHECKING:
    from skyspot.events import EventWriter
    from skyspot.recipe import Recipe
    from skyspot.trainer.cluster import Placement
    from skyspot.trainer.comm import Comm
    from skyspot.trainer.interval import IntervalPlanner
    from skyspot.trainer.preemption import SavePredictor
    from skyspot.trainer.writer import CheckpointWriter, WriteResult

TRAINER_STATE = "trainer_state_rank_{rank}.pt"

Kind = Union[CheckpointKind, Literal["interval", "requested", "emergency", "final"]]
"""A CheckpointKind (events.py) or its value: `save` reads it into the enum."""
Outcome = tuple[bool, bool, Optional[str]]
"""A node leader's answer for one step in find(): (ok, tried the store, one-line note)."""


class ResumeSource(Protocol):
    """Somewhere else checkpoints may be (the run's store). The same answer on every rank."""

    name: str

    def steps(self) -> Optional[list[int]]:
        """Steps this source holds durable; None when it could not be asked (unreachable)."""

    def plan_fetch(self, step: int) -> Any:
        """This node's part of `step` (a remote.PartPlan: its file table, manifest and marker), or raise
        (CheckpointError, StoreError). Called on node leaders; sent to the node's other ranks."""

    def fetch_share(self, plan: Any, names: list[str], directory: Path) -> None:
        """Download and verify `names` of `plan` into `directory`, or raise. Called on every rank of the
        node at once, each with its own share; the leader then commits the whole (remote.complete_part)."""

    # Optional: `fetch_part(step, node_rank, directory) -> Path`, another node's part of a step, for a
    # resume at another world size (reshard.gather). Without it such a resume needs every rank here.


@dataclass
class ResumePoint:
    step: int
    path: Path
    source: str
    manifest: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    find_seconds: float = 0.0
    """How long the ranks took to agree on it, store downloads included (the `resume` event's)."""


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


def choose(
    views: list[list[mf.Verdict]], remote: Optional[list[set[int]]] = None, remote_failed: tuple[str, ...] = ()
) -> Choice:
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


def retention_victims(
    verdicts: list[mf.Verdict], keep: int, newest: int, can_delete: Callable[[int], bool]
) -> list[Path]:
    """What retention removes after `newest` was committed. Pure.

    Keeps the newest `keep` committed checkpoints up to `newest` (always including `newest`),
    anything newer than `newest`, and any committed checkpoint a hook refuses to let go; removes
    older committed ones and older directories that never committed (leftovers of a cut write).
    """
    older = [v for v in verdicts if v.step <= newest]
    committed = sorted((v for v in older if v.state == "valid"), key=lambda v: v.step, reverse=True)
    kept = {v.step for v in committed[: max(1, keep)]} | {newest}
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


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _ranks(n) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def resharding(manifest: dict[str, Any], world_size: int, num_nodes: Optional[int] = None) -> bool:
    """True when a checkpoint's ZeRO-3 shards were written by another number of ranks, or spread
    over another number of nodes (each node's disk holds its own ranks' files): reshard.py."""
    if int(manifest.get("world_size") or world_size) != world_size:
        return True
    return num_nodes is not None and int(manifest.get("num_nodes") or num_nodes) != num_nodes


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        placement: "Placement",
        recipe: "Recipe",
        *,
        run_id: str,
        attempt: int,
        events: Optional["EventWriter"],
        comm: "Comm",
        warn: Callable[[str], None],
        resume_source: Optional[ResumeSource] = None,
        on_committed: Sequence[Callable[[int, Path], None]] = (),
        can_delete: Sequence[Callable[[int], bool]] = (),
        stream_sink=None,
        predictor: Optional["SavePredictor"] = None,
        history: Callable[[], list[dict]] = list,
    ):
        self.run_dir = Path(run_dir)
        self.root = checkpoints_dir(self.run_dir)
        self.placement = placement
        self.recipe = recipe
        self.run_id = run_id
        self.attempt = attempt
        self.events = events  # run-level events only on global rank 0
        self.comm = comm
        self.warn = warn
        self.last_committed: Optional[int] = None
        """The newest step this start committed or resumed from (read by the loop's messages)."""
        self._resume_source = resume_source
        self._on_committed = list(on_committed)
        self._can_delete = list(can_delete)
        self._stream_sink = stream_sink  # the node's uploader (node leaders): which files arrived by stream
        self._predictor = predictor
        self._history = history
        self._engine = None
        self._writer: Optional["CheckpointWriter"] = None
        self._every_steps = recipe.checkpoint.every_steps
        value = recipe.checkpoint.every_seconds
        self._every_seconds: Optional[float] = None if value == "auto" else value  # auto: _plan_interval()
        self._planner: Optional["IntervalPlanner"] = None  # every_seconds=auto, on global rank 0
        self._last_save_time = time.monotonic()
        if placement.is_node_leader:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def _adapters_only(self) -> bool:
        """LoRA: checkpoints hold what training changes (adapters, their optimizer state), not the frozen base."""
        return self.recipe.train.lora is not None

    @property
    def writing(self) -> bool:
        """Whether a checkpoint is still being written in the background (a save now would wait for it)."""
        return self._writer is not None and self._writer.in_flight

    def _plan_interval(self) -> None:
        """checkpoint.every_seconds=auto: global rank 0 plans the interval (interval.py) and re-plans
        after each committed checkpoint. The history hook gives earlier attempts' events when the run
        directory has none (a fresh node: the store's copy)."""
        if self.recipe.checkpoint.every_seconds != "auto" or not self.placement.is_global_zero:
            return
        from skyspot.events import EVENTS_DIR
        from skyspot.trainer.interval import IntervalPlanner

        events_dir = self.run_dir / EVENTS_DIR
        earlier = any(not name.startswith(f"attempt-{self.attempt}.") for name in _names(events_dir))
        try:
            past = [] if earlier else self._history()
        except Exception as err:  # planning is advice: never stop training over it
            self.warn(f"checkpoint.every_seconds=auto: the store's event history is unreadable ({err})")
            past = []
        emit = self.events.emit if self.events is not None else (lambda *a, **k: None)
        self._planner = IntervalPlanner(
            self.recipe, self.placement.where.get("cloud"), events_dir, history=past, emit=emit, say=self.warn
        )
        self._every_seconds = self._planner.replan("start")
        self._last_save_time = time.monotonic()  # the interval counts training time, not start-up

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
        started = time.monotonic()
        source = self._resume_source
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
            views = [view for view in self.comm.io_gather(mine) if view is not None]
            all_failed = tuple(line for view in views for line in view[2])
            choice = choose([view[0] for view in views], [set(view[1]) for view in views], all_failed)
            if choice.step is None:
                for line in choice.warnings + notes:
                    self._say(line)
                if choice.problem:
                    raise CheckpointError(
                        f"{self.root}: {choice.problem}. Nothing was started over. Repair or move the "
                        "checkpoints, or pass --fresh to start from step 0 (old checkpoints are moved aside, not deleted)"
                    )
                if unreachable:
                    raise StoreError(
                        f"cannot list the store {source.name}, and no node has a local checkpoint: nothing was "
                        "started, since starting over could overwrite the run's progress there. Start again "
                        "when the store is reachable"
                    )
                return None
            have, local = None, None
            if self.placement.is_node_leader:
                have, local = self._have(choice.step, mine[0], remote - bad_remote, verified)
            # Collective: the nodes that lack the step fetch it, every local rank its share, at once.
            ok, fetched, note = self._fetch(choice.step, have, local, verified) or (True, False, None)
            if self.placement.is_node_leader:
                if not ok and choice.step in remote and choice.step not in bad_remote and fetched:
                    bad_remote.add(choice.step)
                    failed.append(note)
                elif not ok and not fetched and note:
                    failed.append(note)  # it held a committed checkpoint: never a silent fresh start
                fetched = fetched and ok
            outcome = self.comm.io_gather((ok, fetched, note))
            notes += [n for _, _, n in outcome if n]
            if all(o for o, _, _ in outcome):
                for line in choice.warnings + notes:
                    self._say(line)
                path = self.root / mf.step_dir_name(choice.step)
                verdict = mf.inspect(path, verify_checksums=False)
                source_name = "store" if any(f for _, f, _ in outcome) else "local"
                return ResumePoint(
                    choice.step,
                    path,
                    source_name,
                    verdict.manifest or {},
                    choice.warnings + notes,
                    find_seconds=time.monotonic() - started,
                )

    def _have(
        self, step: int, scanned: list[mf.Verdict], remote: set[int], verified: dict[int, mf.Verdict]
    ) -> tuple[Optional[Outcome], Optional[mf.Verdict]]:
        """Node leader: is `step` valid here? ((ok, tried the store, one-line note), or None when the store
        must supply it; the local verdict)."""
        local = next((v for v in scanned if v.step == step), None)
        if local is not None and local.state == "valid" and not local.verified:
            local = verified[step] = mf.inspect(local.path, verify_checksums=True)
        if local is not None and local.state == "valid" and not self._lacks_parts(local, remote):
            return (True, False, None), local
        if local is not None and local.state == "valid":
            verified[step] = replace(
                local,
                state="incomplete",
                reason="written by more nodes; the others' parts are neither here nor durable in the store",
            )
            return (
                False,
                False,
                (
                    f"node {self.placement.node_rank}: step_{step} was written by "
                    f"{local.manifest.get('num_nodes')} nodes and cannot be resharded from this "
                    "node's part alone"
                ),
            ), local
        if local is not None:
            verified[step] = local
        return (None if step in remote else (False, False, None)), local

    def _fetch(
        self, step: int, have, local: Optional[mf.Verdict], verified: dict[int, mf.Verdict]
    ) -> Optional[Outcome]:
        """Every rank (collective, on the I/O group): each node leader that must fetch `step` plans its node's
        part (marker, manifest), then every rank of that node downloads and verifies its share of the files
        at once (remote.shares: one process per rank, so a 210 GB part comes down in parallel, not through
        one interpreter), and the leader commits the whole into place. The leader's (ok, tried the store,
        note), or `have` when it needed nothing; None on the other ranks."""
        from skyspot.trainer.remote import complete_part, shares, staging_dir

        p, source = self.placement, self._resume_source
        need = p.is_node_leader and have is None
        plan, temp, error = None, None, None
        if need:
            try:
                plan = source.plan_fetch(step)
                temp = staging_dir(self.root / mf.step_dir_name(step))
            except (CheckpointError, StoreError, OSError) as err:
                error = str(err)
        views = self.comm.io_gather((p.node_rank, plan, str(temp)) if plan is not None and temp is not None else None)
        ours = next((v for v in views if v is not None and v[0] == p.node_rank), None)
        share_error = None
        if ours is not None:
            try:
                names = shares(ours[1].files, p.local_world_size)[p.local_rank]
                if names:
                    source.fetch_share(ours[1], names, Path(ours[2]))
            except (CheckpointError, StoreError, OSError) as err:
                share_error = str(err)
        errors = self.comm.io_gather((p.node_rank, share_error) if ours is not None else None)
        if not need:
            return have
        verdict = None
        try:
            failures = [v[1] for v in errors if v is not None and v[0] == p.node_rank and v[1]]
            if error or failures:
                raise CheckpointError(error or failures[0])
            complete_part(plan, temp, self.root / mf.step_dir_name(step))
            verdict = mf.inspect(self.root / mf.step_dir_name(step), verify_checksums=False)
            if verdict.state != "valid":
                raise CheckpointError(f"checkpoint step_{step} from {source.name}: {verdict}")
        except (CheckpointError, StoreError, OSError) as err:
            return False, True, f"node {p.node_rank}: {err}; falling back to an earlier checkpoint"
        finally:
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)
        verified[step] = verdict
        prefix = f"node {p.node_rank}: local step_{step} {local.state}; " if local is not None else ""
        return True, True, (prefix + f"downloaded step_{step} from {source.name}") if prefix else None

    def _lacks_parts(self, local: mf.Verdict, remote: set[int]) -> bool:
        """A step written at another world size needs every rank's files on this node: true when
        they are not all here and the store cannot supply the rest."""
        from skyspot.trainer.reshard import ranks_present

        manifest = local.manifest or {}
        if not resharding(manifest, self.placement.world_size, self.placement.num_nodes) or local.step in remote:
            return False
        return not ranks_present(local.path) >= set(range(int(manifest.get("world_size") or 1)))

    def _say(self, line: str) -> None:
        if self.placement.is_global_zero:
            self.warn(line)

    def _attach(self, engine) -> None:
        """Route DeepSpeed's checkpoint files through our snapshot engine and background writer."""
        from skyspot.trainer.snapshot import BufferPool, SnapshotCheckpointEngine
        from skyspot.trainer.writer import CheckpointWriter

        self._engine = engine
        target = getattr(self._resume_source, "stream_target", None)  # durable.StoreTier: stream while writing
        self._writer = CheckpointWriter(
            rank=self.placement.rank,
            node_rank=self.placement.node_rank,
            is_node_leader=self.placement.is_node_leader,
            exchange=self.comm.writer_exchange,
            on_committed=self._on_committed,
            after_commit=self._retain,
            warn=self.warn,
            streams=target() if target is not None else None,
        )
        self._writer.stream_sink = self._stream_sink
        engine.checkpoint_engine = SnapshotCheckpointEngine(self._writer, BufferPool())

    def load(self, point: Optional[ResumePoint], engine) -> Optional[Restored]:
        """Take over `engine`'s checkpoint files (our snapshot engine and writer), restore its state,
        the RNG states and the data position from `point` (collective; None: a fresh start), then plan
        the interval (every_seconds=auto)."""
        self._attach(engine)
        restored = self._restore(point) if point is not None else None
        self._plan_interval()
        return restored

    def _restore(self, point: ResumePoint) -> Restored:
        from skyspot.trainer import safe_load
        from skyspot.trainer.determinism import replay_adam_bias_correction, restore_rng, seed_for_resume
        from skyspot.trainer.engine import basic_optimizer

        start = time.monotonic()
        m = point.manifest
        state = TrainState(int(m["step"]), int(m["samples"]), int(m["tokens"]), dict(m["data"]))
        resharded = resharding(m, self.placement.world_size, self.placement.num_nodes)
        convert_seconds = 0.0
        if resharded:
            load_dir, convert_seconds = self._universal(point)  # vets the source's files (reshard.convert)
        else:
            self._vet(point)
            load_dir = self.root
        # With LoRA the checkpoint holds only the trainable state: the frozen base is not in it (it was
        # loaded from its files before), so the module state is loaded non-strictly.
        path, _ = self._engine.load_checkpoint(
            str(load_dir),
            tag=point.path.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not self._adapters_only,
        )
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {point.path}")
        if resharded:
            seed_for_resume(self.recipe.train.seed, self.placement.rank, state.step)
        else:
            own = safe_load.load(point.path / TRAINER_STATE.format(rank=self.placement.rank), map_location="cpu")
            restore_rng(own["rng"])
        replay_adam_bias_correction(basic_optimizer(self._engine))
        if self._engine.global_steps != state.step:
            raise CheckpointError(
                f"{point.path}: DeepSpeed restored global step {self._engine.global_steps}, "
                f"the manifest says {state.step}"
            )
        self.last_committed = state.step
        self._last_save_time = time.monotonic()
        seconds = time.monotonic() - start
        self._emit(
            "resume",
            step=state.step,
            checkpoint=str(point.path),
            source=point.source,
            load_seconds=round(seconds, 6),
            find_seconds=round(point.find_seconds, 6),
            bytes=m.get("bytes"),
            samples=state.samples,
            tokens=state.tokens,
            skipped=point.warnings,
            **(
                {
                    "world_size_from": m.get("world_size"),
                    "world_size": self.placement.world_size,
                    "convert_seconds": round(convert_seconds, 6),
                }
                if resharded
                else {}
            ),
        )
        return Restored(state, seconds, int(m.get("bytes") or 0))

    def _vet(self, point: ResumePoint) -> None:
        """Every file this rank is about to load, through the weights-only loader first, and every rank
        told if any refused one (collective): a file planted for one rank must stop them all, not leave
        the others waiting in DeepSpeed's load for a rank that has gone (trainer/safe_load.py)."""
        from skyspot.trainer import safe_load

        error = None
        try:
            for name, entry in sorted((point.manifest.get("files") or {}).items()):
                if isinstance(entry, dict) and entry.get("rank") == self.placement.rank and name.endswith(".pt"):
                    safe_load.vet(point.path / name)
        except CheckpointError as err:
            error = f"rank {self.placement.rank}: {err}"
        errors = [e for e in self.comm.all_gather_object(error) if e]
        if errors:
            raise CheckpointError(errors[0])

    def _universal(self, point: ResumePoint) -> tuple[Path, float]:
        """Node leaders convert `point` to a universal checkpoint (cached); every rank waits. Collective."""
        from skyspot.trainer import reshard

        start = time.monotonic()
        m, error = point.manifest, None
        if self.placement.is_node_leader:
            staging = reshard.universal_root(self.run_dir) / f".gather-{point.path.name}"
            try:
                sha = reshard.manifest_sha256(point.path)
                if reshard.cached(self.run_dir, point.step, sha) is None:
                    fetch = getattr(self._resume_source, "fetch_part", None)
                    source = reshard.gather(
                        point.path,
                        int(m["world_size"]),
                        int(m.get("num_nodes") or 1),
                        (lambda node, d: fetch(point.step, node, d)) if fetch else None,
                        staging,
                    )
                    workers = max(1, min(8, (os.cpu_count() or 1) // max(1, self.placement.local_world_size)))
                    reshard.convert(source, self.run_dir, point.step, sha, workers=workers)
            except (CheckpointError, StoreError, OSError) as err:
                error = f"node {self.placement.node_rank}: {err}"
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        errors = [e for e in self.comm.io_gather(error) if e]  # while node leaders gather and convert
        if errors:
            raise CheckpointError(errors[0])
        seconds = time.monotonic() - start
        if self.placement.is_global_zero:
            self.warn(
                f"step_{point.step} was written by {_ranks(m.get('world_size'))} on {m.get('num_nodes')} "
                f"node(s), this start has {self.placement.world_size} on {self.placement.num_nodes}: converted to a universal checkpoint in {seconds:.1f} s"
            )
        return reshard.universal_root(self.run_dir), seconds

    # ------------------------------------------------------------------ save
    def interval_elapsed(self) -> bool:
        """This process's view of the time interval. The loop puts global rank 0's into the step
        boundary's vote (one all-gather per step) and hands the agreed answer to save(time_due=...)."""
        return self._every_seconds is not None and time.monotonic() - self._last_save_time >= self._every_seconds

    def _due(self, step: int, requested: bool) -> bool:
        if step == self.last_committed:
            return False
        return requested or (self._every_steps is not None and step % self._every_steps == 0)

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        kind: Kind = "interval",
        time_due: bool = False,
        deadline: Optional[float] = None,
        blocking: bool = False,
    ) -> Optional["WriteResult"]:
        """Checkpoint `step` when it is due (collective, with the same arguments on every rank).

        `interval`: when the policy says so (every_steps, or `time_due`, the ranks' agreed answer to
        interval_elapsed()); `requested` (a signal, a warning): unless this step is committed already;
        `emergency` and `final`: always. `deadline` (a preemption's, wall clock): checkpoint streams
        still running then are abandoned. Blocks for the snapshot; with `blocking`, until committed,
        and returns the write's result (None when nothing was saved or it goes on in the background).
        """
        kind = CheckpointKind(kind)
        if kind in (CheckpointKind.INTERVAL, CheckpointKind.REQUESTED) and not self._due(
            step, kind is CheckpointKind.REQUESTED or time_due
        ):
            return None
        if deadline is not None:
            self._writer.set_deadline(deadline)
        from skyspot.trainer.determinism import capture_rng

        previous = self._writer.wait()  # one writer per directory; and the buffers are free again
        self.poll()
        if previous is not None and previous.committed and previous.step == step:
            return previous  # e.g. an emergency right after an interval save of the same step
        start = time.monotonic()
        if self._predictor is not None:
            self._predictor.started(step, time.time())
        directory = self.root / mf.step_dir_name(step)
        self._emit("checkpoint_begin", step=step, kind=kind)
        if self.placement.is_node_leader and directory.exists():
            # A leftover of a cut write or a step not valid on every node: never write into it.
            stale = self.root / f".stale-{directory.name}-{self.attempt}-{os.getpid()}"
            os.replace(directory, stale)
            mf.remove_checkpoint_dir(stale)
        self.comm.barrier()
        self._writer.begin(step, kind, directory)
        try:
            self._engine.save_checkpoint(
                str(self.root),
                tag=directory.name,
                client_state={},
                save_latest=False,
                exclude_frozen_parameters=self._adapters_only,
            )
            self._writer.add(
                directory / TRAINER_STATE.format(rank=self.placement.rank),
                {
                    "rng": capture_rng(),
                    "step": step,
                    "samples": state.samples,
                    "tokens": state.tokens,
                    "data": state.data,
                },
            )
        except BaseException:
            self._writer.abandon()
            raise
        blocked = time.monotonic() - start
        self._writer.submit(self._manifest(step, kind, state), blocked)
        self._last_save_time = time.monotonic()
        if blocking:
            result = self._writer.wait()
            self.poll()
            return result
        return None

    def _manifest(self, step: int, kind: CheckpointKind, state: TrainState) -> dict[str, Any]:
        import deepspeed
        import torch

        p = self.placement
        return {
            "format": mf.FORMAT,
            "step": step,
            "kind": kind,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "created_at": time.time(),
            "samples": state.samples,
            "tokens": state.tokens,
            "data": state.data,
            "world_size": p.world_size,
            "num_nodes": p.num_nodes,
            "node_rank": p.node_rank,
            "recipe_fingerprint": self.recipe.fingerprint(),
            "recipe": self.recipe.model_dump(mode="json"),
            "deepspeed_tag": mf.step_dir_name(step),
            "rank_state_files": TRAINER_STATE.format(rank="<R>"),
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        }

    def poll(self) -> Optional["WriteResult"]:
        """Report a finished background write (events, the predictor, the interval's re-plan); its result, once."""
        if self._writer is None:
            return None
        result = self._writer.poll()
        if result is None:
            return None
        if result.committed:
            self.last_committed = result.step
            if self._predictor is not None:
                self._predictor.observe_commit(result.blocked_seconds, result.write_seconds)
            self._emit(
                "checkpoint_end",
                step=result.step,
                kind=result.kind,
                blocked_seconds=round(result.blocked_seconds, 6),
                write_seconds=round(result.write_seconds, 6),
                bytes=result.bytes,
                path=str(result.path),
                committed_at=result.committed_at,
            )
            if self._planner is not None and result.kind != CheckpointKind.EMERGENCY:
                self._every_seconds = self._planner.replan(f"after step_{result.step}")
        else:
            self._emit("checkpoint_failed", step=result.step, kind=result.kind, error=result.error)
            self._say(f"checkpoint step_{result.step} failed: {result.error}")
        return result

    def wait(self) -> Optional["WriteResult"]:
        """Block until the checkpoint being written is committed or failed; its result."""
        result = self._writer.wait() if self._writer is not None else None
        self.poll()
        return result

    def close(self, timeout: Optional[float] = None) -> None:
        if self._writer is not None:
            self._writer.close(timeout)
            self.poll()

    def _retain(self, step: int, path: Path) -> None:
        """Writer thread, node leader, after `step` is committed on every node."""
        verdicts = mf.scan(self.root, verify_checksums=False)
        allow = lambda s: all(hook(s) for hook in self._can_delete)  # noqa: E731
        for victim in retention_victims(verdicts, self.recipe.checkpoint.keep, step, allow):
            mf.remove_checkpoint_dir(victim)
