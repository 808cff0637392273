"""The trainer: DeepSpeed ZeRO-3 on every rank, resumed exactly, checkpointed atomically.

Launch, one line per node (the task's `run` and the local executor do exactly this):

    python -m skyspot.trainer.supervise --run-dir DIR -- \\
        torchrun --nnodes N --nproc_per_node P --max-restarts R --rdzv_backend c10d \\
        --rdzv_endpoint HEAD:PORT --rdzv_id RUN --rdzv_conf is_host=1|0 --local_addr NODE_IP \\
        -m skyspot.trainer RECIPE --run-dir DIR [--run-name NAME] [--fresh] [key=value ...]

On this machine (2 CPU ranks, gloo):

    torchrun --nproc_per_node 2 -m skyspot.trainer tiny --run-dir runs/t1 train.steps=40

RECIPE is a registry name or a recipe file; key=value overrides as in the CLI: every recipe value
a launch set reaches the node this way, the store too (`storage.store=URI`; task/render.py). Every start
resumes from the newest checkpoint valid on every node, in DIR/checkpoints or in the store
(or exits 3 when the run has checkpoints but none is usable); --fresh moves earlier work aside
and starts from step 0. With a store (storage.store) each node leader uploads its
committed checkpoints and event files in the background (durable.py, uploader.py).
Exit codes: exit_codes.py (0 complete, 75 preempted and saved: recover me, 3, 2, 1).

Reads top to bottom: setup, resume, loop, save, cleanup. `main()` closes everything in `finally`.
One concept although long: one start of the trainer, kept in one file in the order it runs (as
nanoGPT's train.py), so the step boundary, the notice window and the emergency path read in sequence.
"""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from skyspot.start_bounds import start_bounds
from skyspot.trainer import cluster
from skyspot.trainer.exit_codes import (COMPLETE, ERROR, FINAL, NO_VALID_CHECKPOINT, PREEMPTED, Preempted, code_for,
                                        describe, process_code, write_exit_record)
from skyspot.trainer.parent_death import set_parent_death_signal
from skyspot.trainer.preemption import Pending, PreemptionWatch

if TYPE_CHECKING:  # heavy or only needed for the types of Run's fields
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from skyspot.events import EventWriter
    from skyspot.recipe import Recipe
    from skyspot.trainer.base import BaseModel
    from skyspot.trainer.checkpoint import CheckpointManager, Restored
    from skyspot.trainer.comm import Comm
    from skyspot.trainer.data import DataOrder, Samples
    from skyspot.trainer.evaluate import Evaluator
    from skyspot.trainer.durable import StoreTier
    from skyspot.trainer.metrics import MetricsSink
    from skyspot.trainer.model import ByteTokenizer
    from skyspot.trainer.notice import Watcher
    from skyspot.trainer.preemption import SavePredictor
    from skyspot.trainer.restart import Generation
    from skyspot.trainer.rundir import RunLock
    from skyspot.trainer.uploader import Uploader



def say(line: str) -> None:
    """Diagnostics go to stderr (stdout carries the loss lines)."""
    print(f"[skyspot] {line}", file=sys.stderr, flush=True)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m skyspot.trainer",
        description="Train a recipe with DeepSpeed ZeRO-3; resume automatically from DIR/checkpoints.")
    parser.add_argument("recipe", metavar="RECIPE", help="registry name (e.g. tiny) or a recipe file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides, e.g. train.steps=40 storage.store=s3://bucket/prefix")
    parser.add_argument("--run-dir", required=True, type=Path, help="the run's local directory (fast tier)")
    parser.add_argument("--run-name", default=None, help="run id (default: SKYSPOT_RUN_NAME, SKYPILOT_TASK_ID, DIR's name)")
    parser.add_argument("--fresh", action="store_true",
                        help="start from step 0: earlier checkpoints and final/ are moved to DIR/superseded/")
    return parser.parse_intermixed_args(argv)


# --------------------------------------------------------------------------- setup


@dataclass
class Run:
    """One start of the trainer on this rank: what setup found, what build made, where the loop is."""

    args: argparse.Namespace
    recipe: Recipe
    placement: cluster.Placement
    run_id: str
    attempt: int
    events: EventWriter
    comm: Comm
    watch: PreemptionWatch
    ckpt: Optional[CheckpointManager] = None
    engine: Optional[DeepSpeedEngine] = None
    tokenizer: Optional[ByteTokenizer | PreTrainedTokenizerBase] = None
    samples: Optional[Samples] = None
    order: Optional[DataOrder] = None
    device: Optional[torch.device] = None
    keepalive: Optional[object] = None
    """What build_model keeps alive beside the model (model.py)."""
    lock: Optional[RunLock] = None
    notice_watcher: Optional[Watcher] = None
    resumed: Optional[Restored] = None
    step: Optional[int] = None
    base: Optional[BaseModel] = None
    """Where the pretrained model's files are on this node (hub models)."""
    tier: Optional[StoreTier] = None
    """The run's store, when it has one (every rank)."""
    uploader: Optional[Uploader] = None
    """The node's upload worker, on node leaders when the run has a store."""
    upload_deadline: Optional[float] = None
    """Set by the emergency path: uploads end by then."""
    predictor: Optional[SavePredictor] = None
    """How long an emergency save takes to be safe, as measured (every rank)."""
    notice: Optional[dict[str, Any]] = None
    """Once the ranks agreed on a notice: its step, time, deadline and how training through it went."""
    final: Optional[Path] = None
    """DIR/final/ once global rank 0 wrote it (uploaded on the way out)."""
    evaluator: Optional[Evaluator] = None
    """The held-out set's evaluations, when the recipe names one (evaluate.py)."""
    generation: Optional[Generation] = None
    """Which start of the workers within this node's start this is (restart.py: restarts in place)."""
    metrics: Optional[MetricsSink] = None
    """Global rank 0's dashboards (metrics.backends), fed from its own events (trainer/metrics/)."""

    @property
    def run_dir(self) -> Path:
        return self.args.run_dir

    def emit(self, type: str, **fields: Any) -> None:
        """Run-level events come from global rank 0."""
        if self.placement.is_global_zero and self.events is not None:
            self.events.emit(type, **fields)


def _die_with_parent() -> None:
    """SIGKILL this worker if torchrun dies, so an orphan can never write into DIR beside the next start."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if not set_parent_death_signal(signal.SIGKILL):
        return
    if os.getppid() != parent or not _is_launcher(parent):
        # torchrun died before prctl took effect (even before `parent` was read: this process was
        # handed to init or a subreaper): an orphan must not go on into DIR. The random-kill harness
        # caught one (a kill of the supervisor's group while the workers were still importing).
        os._exit(ERROR)


def _is_launcher(pid: int) -> bool:
    """Whether `pid` is a torch elastic launcher (torchrun, python -m torch.distributed.run)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return True  # cannot tell: trust the parent check above
    return b"torchrun" in command or b"torch.distributed.run" in command or b"torch.distributed.launch" in command


def _standalone_env() -> None:
    """Allow `python -m skyspot.trainer` without torchrun: a world of one on loopback."""
    from skyspot.ports import LOOPBACK, free_port

    if "RANK" in os.environ:
        return
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": LOOPBACK,
                       "MASTER_PORT": str(free_port())})


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    import deepspeed.utils.logging as ds_logging

    ds_logging.logger.setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def setup(args: argparse.Namespace, watch: PreemptionWatch) -> Run:
    from skyspot.recipe import load_recipe
    from skyspot.trainer.gpu import require_cuda
    from skyspot.trainer.stacks import allow_stack_dumps

    _die_with_parent()
    allow_stack_dumps(args.run_dir)  # the supervisor's watchdog may read this rank's stacks (stacks.py)
    cluster.pin_rank()  # before anything reads RANK: the ranks stay with their node (cluster.py)
    _standalone_env()
    placement = cluster.from_environment()
    # Before anything else, DeepSpeed's import included (it would pick its CPU accelerator): a node
    # that was given GPUs trains on them or not at all (gpu.py; exit 2, only the exit record written).
    require_cuda(int(os.environ.get("LOCAL_WORLD_SIZE") or 1))  # torchrun's; a standalone start is one rank
    # Shutdown warnings are watched from here, before the slow part of setup and the model load:
    # Azure turns Scheduled Events on at the first request and delivers events minutes later, so an
    # attempt's first minutes are covered only if that request goes out now (notice.py).
    notice_watcher = _start_notice_watcher(watch) if placement.is_node_leader else None
    recipe = load_recipe(args.recipe, args.overrides)
    _check_local_paths(recipe)  # before the slow imports: a missing directory is one line in a second

    if placement.is_node_leader:  # before any rank loads an op: a killed build's lock would hang them all
        from skyspot.trainer.ext_lock import clear_stale

        clear_stale(say=lambda line: print(f"[skyspot] {line}", file=sys.stderr, flush=True))
    _quiet_libraries()
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from skyspot.errors import StoreError, UsageError
    from skyspot.events import EventWriter
    from skyspot.trainer.comm import Comm
    from skyspot.trainer.determinism import configure_threads
    from skyspot.trainer.durable import Probe, StoreTier, restore_run_json
    from skyspot.trainer.rundir import RunLock, move_aside, next_attempt, record_attempt, write_run_json

    threads = configure_threads(placement.local_world_size)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(placement.local_rank)
    # The rendered task sets SKYSPOT_DIST_TIMEOUT_SECONDS so a lost node fails the others fast
    # instead of hanging a paid cluster (skyspot/task/render.py DIST_ENV).
    timeout = timedelta(seconds=float(os.environ.get("SKYSPOT_DIST_TIMEOUT_SECONDS") or 600))
    from skyspot.trainer import fabric

    backend = accelerator.communication_backend_name()
    # Before NCCL starts: the node leader's NCCL says which transport it chose (the `fabric` event).
    nccl_log = fabric.prepare(args.run_dir, backend=backend, node_leader=placement.is_node_leader)
    cluster.init_process_group(backend, timeout)  # the pinned ranks; else DeepSpeed's env:// below
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    comm = Comm(start_bounds(recipe).io_seconds)  # the I/O group waits as long as this recipe's download may take
    device = torch.device(accelerator.current_device_name())
    run_id = cluster.run_id(args.run_name, args.run_dir)

    # One trainer per run directory: a second start while one runs would write beside it.
    lock = RunLock(args.run_dir) if placement.is_node_leader else None
    holder = lock.acquire() if lock is not None else None
    holders = [h for h in comm.all_gather_object(holder) if h]
    if holders:
        raise UsageError(f"{args.run_dir} is in use by another trainer ({holders[0]}); one trainer per run directory")

    # A restart in place (torchrun restarted the workers) continues the attempt: same number, no --fresh.
    from skyspot.trainer import restart

    generation = restart.begin(args.run_dir, placement, comm, recipe.resilience, say)
    if generation.in_place:
        args.fresh = False

    # The store, asked once by global rank 0 (attempt counter, durable checkpoints, run.json).
    store_uri = recipe.storage.store
    tier, probe = None, None
    if store_uri:
        try:
            tier = StoreTier(store_uri, run_id, placement, warn=say)
        except StoreError as err:  # a backend that cannot be opened
            raise UsageError(str(err)) from None
        if placement.rank == 0:
            probe = tier.probe(fresh=bool(args.fresh), count=not generation.in_place)
        probe = comm.io_gather(probe)[0] or Probe()  # the probe retries a slow store for ~30 s
        if probe.usage_error:
            raise UsageError(probe.usage_error)
        if probe.warning and placement.is_global_zero:
            say(probe.warning)
        tier.adopt(probe)

    if args.fresh and placement.is_node_leader:
        moved = move_aside(args.run_dir)
        say(f"--fresh: moved earlier checkpoints and final/ to {moved}; starting from step 0" if moved
            else "--fresh: nothing to move aside; starting from step 0")
    comm.barrier()

    attempt = 0
    if placement.rank == 0:
        if generation.in_place and generation.attempt is not None:
            attempt = generation.attempt
        elif probe is not None and probe.attempt is not None:
            attempt = probe.attempt  # the store counts starts across machines; mirrored locally
            record_attempt(args.run_dir, attempt)
        else:
            attempt = next_attempt(args.run_dir)
        restart.record_attempt(args.run_dir, attempt)
    attempt = comm.broadcast_int(attempt, device)
    events = EventWriter(args.run_dir, run_id, attempt, placement.node_rank, placement.rank)
    run = Run(args, recipe, placement, run_id, attempt, events, comm, watch, device=device, lock=lock, tier=tier,
              generation=generation)
    if placement.is_node_leader:
        if probe is not None:
            restore_run_json(args.run_dir, probe, bool(args.fresh))
        _, warning = write_run_json(args.run_dir, run_id=run_id, recipe=recipe, store=store_uri,
                                    world_size=placement.world_size, where=placement.where, fresh=args.fresh)
        if warning and placement.is_global_zero:
            say(warning)
        if tier is not None:
            run.uploader = tier.uploader(events, args.run_dir, recipe.checkpoint.keep)
            if placement.is_global_zero and probe.attempt is not None and (args.fresh or probe.run_json is None):
                run.uploader.sync_small(args.run_dir / "run.json", "run.json")
    if placement.is_global_zero and recipe.metrics.backends:  # from here on its events reach the dashboards
        from skyspot.trainer.metrics import attach

        run.metrics = attach(run, say)
    # The node leader asks its cloud's metadata what it runs on (SkyPilot does not say instance or spot).
    from skyspot.trainer import instance as node_instance

    found = node_instance.read(os.environ) if placement.is_node_leader else None
    run.emit("start", where=node_instance.where_with(placement.where, found), world_size=placement.world_size,
             total_steps=recipe.train.steps, recipe=recipe.name, pid=os.getpid(), fingerprint=recipe.fingerprint(),
             threads=threads, store=store_uri, fresh=bool(args.fresh), **({"instance": found} if found else {}))
    if placement.is_node_leader:
        from skyspot.trainer.local_disk import record_event

        record_event(args.run_dir, events)  # the node's local NVMe as setup measured it (local_disk.py)
        from skyspot.trainer.node_facts import collect

        try:  # what this node is: image, Python, driver, torch, NCCL file, GPUs, fabric (node_facts.py)
            events.emit("node", **collect(os.environ, instance=found, run_dir=args.run_dir))
        except Exception as error:  # noqa: BLE001 - a fact that cannot be read never fails a start
            say(f"node facts not read: {error}")
        fabric.record(nccl_log, backend=backend, num_nodes=placement.num_nodes, events=events, say=say)
    run.notice_watcher = notice_watcher
    return run


def _check_local_paths(recipe) -> None:
    """A local model directory, tokenizer directory or data file that is not on this node (UsageError)."""
    from skyspot import hub

    model = recipe.model
    if model.is_local:
        hub.check_local_model(model.hub_id)
    if model.tokenizer not in (None, "bytes", model.hub_id) and hub.is_local_ref(model.tokenizer):
        hub.check_local_tokenizer(model.tokenizer)
    source = recipe.data.source
    if "://" not in source and source != "synthetic" and not Path(os.path.expanduser(source)).is_file():
        from skyspot.errors import UsageError

        raise UsageError(f"data.source '{source}' is not 'synthetic', hf://org/name, or an existing file")
    held_out = recipe.data.eval_split
    if held_out and not source.startswith("hf://") and "://" not in held_out and not Path(held_out).is_file():
        from skyspot.errors import UsageError

        raise UsageError(f"data.eval_split '{held_out}' is not an existing file (a second file of data.source's format)")


def _start_notice_watcher(watch: PreemptionWatch):
    """The node leader's notices (notice.py), which then reach every rank through the step-boundary
    vote. Under the node's supervisor the watcher runs there, since before torchrun, and this only
    reads the supervisor's notice file at each step boundary (preemption.NoticeFile): no thread here
    competes with training. Started without the supervisor, the node leader runs the watcher itself.
    A preemption, or a planned shutdown close to its deadline, is an emergency; a planned shutdown
    ahead of time, a rebalance recommendation or a harmless maintenance event is an early
    checkpoint, and training goes on."""
    from skyspot.trainer.exit_codes import TOKEN_ENV
    from skyspot.trainer.preemption import NOTICE_FILE_ENV, NoticeFile

    followed = os.environ.get(NOTICE_FILE_ENV, "").strip()
    if followed:
        watch.follow(NoticeFile(Path(followed), os.environ.get(TOKEN_ENV, "")))
        return None
    try:
        from skyspot.trainer.notice import watch_for
    except ImportError:
        return None
    return watch_for(watch)


# --------------------------------------------------------------------------- resume


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: obj}


def reconcile_recipe(recipe, saved: Optional[dict[str, Any]]):
    """The recipe to continue with, and one line per difference from the checkpoint's.

    The architecture (model.*) comes from the checkpoint; everything else from the recipe.
    """
    from skyspot.recipe import ModelSection

    if not saved:
        return recipe, []
    sections = ("model", "data", "train", "deepspeed", "checkpoint")
    now = _flatten({k: v for k, v in recipe.model_dump(mode="json").items() if k in sections})
    then = _flatten({k: v for k, v in saved.items() if k in sections})
    lines = []
    for key in sorted(set(now) | set(then)):
        if now.get(key) != then.get(key):
            winner = "the checkpoint's" if key.startswith("model.") else "the recipe's"
            lines.append(f"recipe differs from the checkpoint: {key} {then.get(key)!r} -> {now.get(key)!r} "
                         f"({winner} value is used)")
    if "model" in saved and saved["model"] != recipe.model.model_dump(mode="json"):
        recipe = recipe.model_copy(update={"model": ModelSection.model_validate(saved["model"])})
    return recipe, lines


def keep_global_batch(recipe, manifest: dict[str, Any], world_size: int):
    """The recipe with micro batch and accumulation re-split so `world_size` ranks keep the
    checkpoint's global batch (data.rebatch), and the line that says so."""
    from skyspot.trainer.data import rebatch

    train = recipe.train
    saved = int((manifest.get("data") or {}).get("global_batch") or 0)
    if saved <= 0:
        return recipe, None
    micro, accum, note = rebatch(saved, train.micro_batch_size, train.grad_accum, world_size)
    if (micro, accum) != (train.micro_batch_size, train.grad_accum):
        recipe = recipe.model_copy(update={"train": train.model_copy(update={"micro_batch_size": micro,
                                                                             "grad_accum": accum})})
    return recipe, (f"world size {manifest.get('world_size')} -> {world_size}: {note}" if note else None)


def _data_source(run: Run, key: str = "source") -> str:
    """Where the ranks read data.source (or data.eval_split, a file source's held-out file): a bucket URI
    is downloaded into DIR/data/ by each node leader first (the task mounts bucket data on cloud nodes,
    so this is for a URI given directly)."""
    from skyspot.errors import UsageError
    from skyspot.trainer.data import local_source_path, resolve_source

    source, cache = getattr(run.recipe.data, key), run.run_dir / "data"
    error = None
    if run.placement.is_node_leader:
        try:
            resolve_source(source, cache, key=f"data.{key}")
        except UsageError as err:
            error = str(err)
    errors = [e for e in run.comm.io_gather(error) if e]  # a node leader's download
    if errors:
        raise UsageError(errors[0])
    return local_source_path(source, cache)


def build(run: Run) -> None:
    """Find the resume point, then build data, model and engine, and restore the state."""
    from skyspot.trainer.base import BaseModel
    from skyspot.trainer.checkpoint import CheckpointManager, resharding
    from skyspot.trainer.data import DataOrder, build_dataset
    from skyspot.trainer.determinism import seed_everything
    from skyspot.trainer.engine import deepspeed_config, initialize
    from skyspot.trainer.model import build_model, load_tokenizer, trainable_count

    from skyspot.trainer.preemption import SavePredictor

    p = run.placement
    history = _store_history(run)
    run.predictor = SavePredictor(store=run.uploader is not None)
    store_hooks = {}
    if run.uploader is not None:
        store_hooks = dict(on_committed=[run.uploader.submit],  # from the writer thread: only enqueues
                           can_delete=[run.uploader.can_delete_local],  # answered from memory
                           stream_sink=run.uploader)  # told which files the writers streamed to the store
    run.ckpt = CheckpointManager(run.run_dir, p, run.recipe, run_id=run.run_id, attempt=run.attempt,
                                 events=run.events if p.is_global_zero else None, comm=run.comm, warn=say,
                                 resume_source=run.tier, predictor=run.predictor, history=history, **store_hooks)
    cfg = run.recipe.checkpoint
    if p.is_global_zero and run.tier is not None and (cfg.every_seconds == "auto" or cfg.train_through_notice):
        try:
            history()  # read now, while the other ranks wait on the I/O group in find(), not in the first vote
        except Exception:  # noqa: BLE001 - advice only; read again (and reported) where it is used
            pass
    point = run.ckpt.find()
    resharded = point is not None and resharding(point.manifest, p.world_size, p.num_nodes)
    if point is not None:
        run.recipe, lines = reconcile_recipe(run.recipe, point.manifest.get("recipe"))
        if resharded:
            run.recipe, note = keep_global_batch(run.recipe, point.manifest, p.world_size)
            lines += [note] if note else []
        if p.is_global_zero:
            for line in lines:
                say(line)
    recipe = run.recipe

    # Config and tokenizer first, then the data: a data set the format cannot read fails here, before
    # any weights move. The weights only where they are needed: a fresh start, or LoRA's frozen base
    # (a resumed full fine-tune gets every parameter from the checkpoint).
    run.base = BaseModel(recipe, run.run_dir, p, run.comm, tier=run.tier, emit=run.emit, say=say)
    run.base.prepare(weights=False)
    run.tokenizer = load_tokenizer(recipe.model, run.base.path)
    run.samples = build_dataset(recipe, run.tokenizer, _data_source(run))
    if p.is_global_zero and run.samples.examples:
        dropped = f"; {run.samples.dropped} left out (nothing to train on within seq_len)" if run.samples.dropped else ""
        say(f"data: {run.samples.examples} examples ({recipe.data.format}) -> {len(run.samples)} sequences of "
            f"{recipe.train.seq_len} tokens ({'packed' if recipe.data.packing else 'padded'}){dropped}")
    run.samples, run.evaluator = _held_out(run, run.samples, history)
    run.order = DataOrder(len(run.samples), recipe.train.seed, recipe.data.shuffle, p.rank, p.world_size,
                          recipe.train.micro_batch_size, recipe.train.grad_accum)
    weights = recipe.model.hub_id is not None and (point is None or recipe.train.lora is not None)
    if weights:
        run.base.prepare(weights=True)

    ds_config = deepspeed_config(recipe)
    if resharded:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True  # reshard.py
    seed_everything(recipe.train.seed)  # the same initial weights on every rank, every start
    model, run.keepalive = build_model(recipe, ds_config, run.tokenizer, run.base.path, load_weights=weights)
    if recipe.train.lora is not None and p.is_global_zero:
        trainable, total = trainable_count(model)
        say(f"LoRA r={recipe.train.lora.r} on {', '.join(recipe.train.lora.target_modules)}: {trainable:,} of "
            f"{total:,} parameters trainable ({trainable / max(1, total):.2%})")
    run.engine = initialize(recipe, model, ds_config)
    if weights:
        run.base.start_copy()

    run.resumed = run.ckpt.load(point, run.engine)  # and plans the interval (every_seconds=auto)
    _seed_predictor(run, history)
    if run.resumed is None:
        seed_everything(recipe.train.seed + 1000 * p.rank)  # dropout etc. differ per rank
    else:
        _apply_schedule(run)
        if point.manifest.get("data", {}).get("num_samples") not in (None, len(run.samples)) and p.is_global_zero:
            say(f"the data set has {len(run.samples)} samples, the checkpoint's had "
                f"{point.manifest['data']['num_samples']}: the order continues by position, not by sample")
        if p.is_global_zero:
            s = run.resumed.state
            say(f"resumed from {point.path} (step {s.step}, {s.samples} samples) in {run.resumed.load_seconds:.2f} s")
    if p.is_global_zero and run.generation is not None:
        from skyspot.trainer.restart import resumed

        resumed(run.generation, run.resumed.state.step if run.resumed else 0)


def _store_history(run: Run):
    """Earlier attempts' events from the store, read at most once (a fresh node has none locally)."""
    cache: list = []

    def read() -> list[dict]:
        if not cache:
            cache.append(run.tier.read_events() if run.tier is not None else [])
        return cache[0]
    return read


def _seed_predictor(run: Run, history) -> None:
    """The save-time predictor behind training through a notice window (preemption.py), seeded from
    earlier attempts: the run directory's events, else (global rank 0, a fresh node) the store's."""
    from skyspot.events import read_events_dir

    p = run.placement
    if run.uploader is not None:
        run.uploader.on_uploaded.append(run.predictor.observe_durable)
    if not run.recipe.checkpoint.train_through_notice or not p.is_node_leader:
        return
    earlier = [e for e in read_events_dir(run.run_dir / "events").events if e.get("attempt") != run.attempt]
    if not earlier and p.is_global_zero and run.tier is not None:
        try:
            earlier = history()
        except Exception as err:  # advice only: without history the first notice saves at once
            say(f"the store's event history is unreadable ({err}); a notice before the first checkpoint saves at once")
            earlier = []
    run.predictor.seed(earlier)  # every node's figures: the slowest node decides anyway


def _apply_schedule(run: Run) -> None:
    """The LR schedule comes from the recipe, the step count from the checkpoint.

    For an unchanged recipe this recomputes exactly the value that was restored (same formula,
    same inputs), so resume stays bitwise; a changed lr or train.steps takes effect at once.
    """
    from skyspot.trainer.engine import lr_factor

    scheduler = run.engine.lr_scheduler
    train = run.recipe.train
    factor = lr_factor(train.warmup_steps, train.steps, train.min_lr_ratio)
    scheduler.base_lrs = [train.lr for _ in scheduler.base_lrs]
    lrs = [base * factor(scheduler.last_epoch) for base in scheduler.base_lrs]
    for group, lr in zip(run.engine.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


# --------------------------------------------------------------------------- loop


@dataclass
class Vote:
    """What the ranks agreed at a step boundary (one all-gather of a few numbers per rank)."""

    loss: float
    tokens: int
    emergency: bool
    checkpoint: bool
    time_due: bool
    first_seen: Optional[float]
    deadline: Optional[float]
    seconds: float
    signaled: bool = False
    """A signal, not only a notice: save now."""
    need_s: float = 0.0
    """The slowest node leader's next step plus predicted save to safety (other ranks send 0); 0 when a
    leader sent -1 (nothing measured yet, or checkpoint.train_through_notice off)."""
    now: float = 0.0
    """Global rank 0's clock at the vote: every rank decides on the same number."""


def _vote(run: Run, loss: float, tokens: int, pending: Pending, time_due: bool, need_s: float = 0.0) -> Vote:
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    mine = torch.tensor([loss, float(tokens), float(pending.emergency), float(pending.checkpoint),
                         float(time_due), pending.first_seen or 0.0, pending.deadline or 0.0,
                         float(pending.signaled), need_s, time.time()],
                        dtype=torch.float64, device=run.device)
    everyone = torch.empty(run.placement.world_size * mine.numel(), dtype=torch.float64, device=run.device)
    dist.all_gather_into_tensor(everyone, mine)
    rows = everyone.view(run.placement.world_size, -1).cpu().tolist()
    seen = [r[5] for r in rows if r[5] > 0]
    deadlines = [r[6] for r in rows if r[6] > 0]
    return Vote(loss=sum(r[0] for r in rows) / len(rows), tokens=int(sum(r[1] for r in rows)),
                emergency=any(r[2] > 0 for r in rows), checkpoint=any(r[3] > 0 for r in rows),
                time_due=rows[0][4] > 0, first_seen=min(seen) if seen else None,
                deadline=min(deadlines) if deadlines else None, seconds=time.perf_counter() - start,
                signaled=any(r[7] > 0 for r in rows), now=rows[0][9],
                need_s=0.0 if any(r[8] < 0 for r in rows) else max(r[8] for r in rows))


def _report_local(run: Run, pending: Pending) -> None:
    """Signals and notices are reported by the rank that saw them."""
    for signum, name, ts in pending.signals:
        run.events.emit("signal", signum=signum, name=name, received=ts)
        say(f"rank {run.placement.rank}: {name}: emergency checkpoint at the next step boundary")
    for notice in pending.notices:
        # A warning (a rebalance recommendation, maintenance ahead of its deadline) ends nothing:
        # its own type, so the cost report's notices are only those that ended an attempt.
        run.events.emit("shutdown_warning" if notice.get("warning") else "preemption_notice",
                        source=notice["source"], deadline=notice["deadline"], action=notice["action"],
                        received=notice["received"])


def _boundary(run: Run, loss: float = 0.0, tokens: int = 0, step_s: float = 0.0) -> Vote:
    pending = run.watch.take()
    _report_local(run, pending)
    time_due = run.placement.is_global_zero and run.ckpt.interval_elapsed()
    return _vote(run, loss, tokens, pending, time_due, _need_seconds(run, step_s))


def _need_seconds(run: Run, step_s: float) -> float:
    """A node leader's time for one more step and a save that ends safe (its node's part durable, or
    committed without a store); -1 when it has measured none yet. Sent every step, since a notice seen
    on one node must be judged by every node's figure. Other ranks send 0: their part is written
    alongside, and the leader's figure (which waits for the whole node) covers it."""
    if not run.placement.is_node_leader:
        return 0.0
    predicted = run.predictor.predict() if run.predictor is not None else None
    if predicted is None or not run.recipe.checkpoint.train_through_notice:
        return -1.0
    if run.ckpt.writing:
        predicted *= 2  # an interval checkpoint still being written goes first
    return step_s + predicted


def _train_through(run: Run, state, vote: Vote) -> bool:
    """Every rank, after a vote with the emergency flag: keep training through the notice window?
    The same answer on every rank (preemption.train_through on the vote's numbers)."""
    from skyspot.trainer.durable import emergency_deadline
    from skyspot.trainer.preemption import train_through

    if run.notice is None:
        run.notice = {"step": state.step, "first_seen": vote.first_seen, "deadline": vote.deadline, "held": 0}
    cfg = run.recipe.checkpoint
    upload_deadline = (emergency_deadline(vote.deadline, vote.first_seen, run.placement.where.get("cloud"))
                       if vote.deadline is not None else None)
    eligible = (cfg.train_through_notice and not vote.signaled and upload_deadline is not None
                and (state.step > 0 or run.resumed is not None))
    hold, early = False, run.notice.get("early")
    if eligible and vote.need_s > 0:
        hold = train_through(now=vote.now, need_s=vote.need_s, margin_s=cfg.notice_margin_seconds,
                             upload_deadline=upload_deadline)
    elif eligible and early is None:
        # Nothing measured yet: checkpoint now (it secures the steps so far and measures the save), and
        # train on while it runs.
        run.notice["early"] = early = {"step": state.step, "at": vote.now}
        run.notice["checkpoint_now"] = True
        hold = vote.now + cfg.notice_margin_seconds < upload_deadline
    elif eligible:
        # Still nothing measured (the early checkpoint is still on its way): use at most half of what
        # was left of the window when it began, so an emergency save still has the other half.
        hold = vote.now < early["at"] + (upload_deadline - early["at"]) / 2
    run.notice["predicted_seconds"] = round(vote.need_s, 3) if vote.need_s > 0 else None
    if hold and run.notice["held"] == 0:
        run.emit("notice_window", step=state.step, deadline=vote.deadline, upload_deadline=round(upload_deadline, 3),
                 predicted_seconds=round(vote.need_s, 3) if vote.need_s > 0 else None,
                 margin_seconds=cfg.notice_margin_seconds, early_checkpoint=early is not None,
                 source=run.predictor.source if run.predictor is not None else None)
        if run.placement.is_global_zero:
            said = (f"a save predicted at {vote.need_s:.1f} s" if vote.need_s > 0 else
                    "no save measured yet: a checkpoint now measures one")
            say(f"preemption notice: training on through the window ({upload_deadline - vote.now:.0f} s to the "
                f"deadline, {said}); emergency checkpoint when it no longer fits")
    if hold:
        run.notice["held"] += 1
    return hold


def _batch(run: Run, indices) -> tuple[Any, Any]:
    """Token ids and labels (-100 where there is no loss: prompts, padding) of these samples."""
    import torch

    ids = torch.from_numpy(run.samples.ids[indices]).to(run.device)
    labels = torch.from_numpy(run.samples.labels[indices]).to(run.device)
    return ids, labels


def train(run: Run) -> int:
    """The loop. Returns the final step when training is complete; raises Preempted after an emergency save."""
    from skyspot.trainer.checkpoint import TrainState
    from skyspot.trainer.faults import fault_point
    from skyspot.trainer.restart import first_step

    recipe, engine, order = run.recipe, run.engine, run.order
    total = recipe.train.steps
    state = run.resumed.state if run.resumed else TrainState(0, 0, 0, order.state(0))
    run.step = state.step

    vote = _boundary(run)  # a signal during setup still gets its (trivial) emergency exit
    if vote.emergency and not _train_through(run, state, vote):
        _emergency(run, state, vote)
    if state.step < total:
        _evaluate(run, state, vote)  # resumed at a step whose eval is missing (it was interrupted)
    step_seconds = 0.0

    while state.step < total:
        start = time.perf_counter()
        lr = engine.get_lr()[0]
        losses = []
        tokens = 0
        for indices in order.step_indices(state.samples):
            ids, labels = _batch(run, indices)
            # A micro-batch of prompt only (possible with packing) has no token to learn: its mean loss
            # would be 0/0 = NaN; summed over nothing it is 0, and so is its gradient.
            empty = not bool((labels[:, 1:] != -100).any())
            loss = engine(input_ids=ids, labels=labels, **({"num_items_in_batch": 1} if empty else {})).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            tokens += int((labels != -100).sum())
        state = TrainState(state.step + 1, state.samples + order.global_batch, state.tokens, {})
        run.step = state.step
        fault_point("step_end", state.step)
        vote = _boundary(run, sum(losses) / len(losses), tokens, step_seconds)
        state.tokens += vote.tokens
        state.data = order.state(state.samples)
        step_seconds = time.perf_counter() - start
        run.ckpt.poll()
        norm = engine.get_global_grad_norm()  # rank 0's copy of the global norm (DeepSpeed), for the dashboards
        run.emit("step", step=state.step, loss=vote.loss, lr=lr, step_seconds=round(step_seconds, 6),
                 samples=state.samples, tokens=state.tokens, sync_seconds=round(vote.seconds, 6),
                 grad_norm=None if norm is None else float(norm))
        first_step(run.generation, run.emit, say)  # after a restart in place: its event (restart.py)
        if run.placement.is_global_zero and (state.step % recipe.train.log_every == 0 or state.step == total):
            print(f"step {state.step}/{total} | loss {vote.loss:.4f} | lr {lr:.3e} | "
                  f"{step_seconds * 1000:.0f} ms/step | {vote.tokens / step_seconds:.0f} tok/s", flush=True)

        if vote.emergency and not _train_through(run, state, vote):
            _emergency(run, state, vote)
        _evaluate(run, state, vote)
        if state.step == total:
            break
        early = run.notice is not None and run.notice.pop("checkpoint_now", False)  # a notice, nothing measured
        if early or run.notice is None:
            run.ckpt.save(state.step, state, kind="requested" if early or vote.checkpoint else "interval",
                          time_due=vote.time_due)

    # ------------------------------------------------------------------ save (complete)
    _finish(run, state)
    return state.step


def _emergency(run: Run, state, vote: Vote) -> None:
    """Every rank: commit an emergency checkpoint of this step together, push it to the store as far
    as the deadline allows, then unwind to exit 75."""
    from skyspot.trainer.durable import emergency_deadline

    if state.step == 0 and run.resumed is None:
        raise Preempted(0, "preempted before the first step: nothing to save")
    run.upload_deadline = emergency_deadline(vote.deadline, vote.first_seen, run.placement.where.get("cloud"))
    if run.uploader is not None:
        run.uploader.set_deadline(run.upload_deadline)  # before the commit hook submits the emergency step
    save_started = time.time()
    result = run.ckpt.save(state.step, state, kind="emergency", deadline=run.upload_deadline, blocking=True)
    committed = result is not None and result.committed
    durable, newest_durable = _push_before_deadline(run, state.step, committed)
    safe_at = time.time()
    if committed:
        first = vote.first_seen or result.committed_at
        run.emit("emergency_checkpoint", step=state.step,
                 signal_to_commit_seconds=round(result.committed_at - first, 6),
                 durable_before_deadline=durable, newest_durable_step=newest_durable,
                 deadline=vote.deadline, upload_deadline=round(run.upload_deadline, 3),
                 committed_before_deadline=None if vote.deadline is None else result.committed_at <= vote.deadline,
                 write_seconds=round(result.write_seconds, 6), blocked_seconds=round(result.blocked_seconds, 6),
                 bytes=result.bytes, **_window_fields(run, state.step, vote, save_started, safe_at, durable))
        raise Preempted(state.step, f"preempted: emergency checkpoint step_{state.step} committed"
                        + ("" if durable is None else " and durable" if durable else ", not durable in the store"))
    raise Preempted(state.step, f"preempted: emergency checkpoint failed ({result.error if result else 'no result'}); "
                                f"resume from step_{run.ckpt.last_committed}")


def _window_fields(run: Run, step: int, vote: Vote, save_started: float, safe_at: float,
                   durable: Optional[bool]) -> dict[str, Any]:
    """How the notice window was spent (emergency_checkpoint fields; docs/trainer.md)."""
    notice = run.notice or {}
    first = vote.first_seen
    window = (vote.deadline - first) if vote.deadline is not None and first else None
    return {"signaled": vote.signaled, "notice_step": notice.get("step"),
            "steps_after_notice": (step - notice["step"]) if notice.get("step") is not None else 0,
            "window_seconds": round(window, 3) if window is not None else None,
            "trained_after_notice_seconds": round(save_started - first, 3) if first else None,
            "notice_to_safe_seconds": round(safe_at - first, 3) if first else None,
            "slack_seconds": round(vote.deadline - safe_at, 3) if vote.deadline is not None else None,
            "predicted_seconds": notice.get("predicted_seconds"),
            "save_to_safe_seconds": round(safe_at - save_started, 3) if durable or durable is None else None}


def _push_before_deadline(run: Run, step: int, committed: bool) -> tuple[Optional[bool], Optional[int]]:
    """Every rank (collective when there is a store): did every node get its part of `step` into the
    store before the deadline, and which is the newest checkpoint every node has there?"""
    if run.tier is None:
        return None, None
    mine = None
    if run.uploader is not None:
        uploaded = run.uploader.flush_until(run.upload_deadline) if committed else False
        have = set(run.uploader.durable_steps()) | {s for s in (step,) if uploaded}
        mine = (uploaded, sorted(have))
    views = [v for v in run.comm.io_gather(mine) if v is not None]  # uploads until the deadline
    durable = committed and bool(views) and all(v[0] for v in views)
    common = set.intersection(*(set(v[1]) for v in views)) if views else set()
    return durable, (max(common) if common else None)


def _finish(run: Run, state) -> None:
    """Training complete: a final checkpoint (so a restart knows), then final/."""
    from skyspot.trainer.export import export_final

    _evaluate(run, state, None)  # resumed at the last step with its eval missing
    if run.ckpt.last_committed != state.step:
        result = run.ckpt.save(state.step, state, kind="final", blocking=True)
        if result is None or not result.committed:
            from skyspot.errors import SkyspotError

            raise SkyspotError(f"the final checkpoint step_{state.step} could not be written "
                               f"({result.error if result else 'no result'}); the next start resumes from "
                               f"step_{run.ckpt.last_committed} once {run.run_dir} has room")
    target = export_final(run.engine, run.tokenizer, run.run_dir, is_writer=run.placement.is_global_zero,
                          merge=run.recipe.export.merge, step=state.step,
                          evaluation=run.evaluator.last if run.evaluator is not None else None)
    if target is not None:
        say(f"training complete at step {state.step}; model written to {target}")
        run.final = target  # uploaded in cleanup, after the ranks' barrier: no rank waits in a collective for it


# --------------------------------------------------------------------------- evaluation


def _held_out(run: Run, samples: Samples, history) -> tuple[Samples, Optional[Evaluator]]:
    """The training set without the held-out part, and the evaluator (None without an eval section).
    Global rank 0 reads which steps this run has already evaluated (its event history: the run
    directory's, else the store's) so no step is evaluated twice; every rank gets its answer."""
    from skyspot.errors import UsageError
    from skyspot.events import read_events_dir
    from skyspot.trainer.data import build_eval_split, training_and_held_out
    from skyspot.trainer.evaluate import build_evaluator, has_tokens

    recipe, p = run.recipe, run.placement
    split = build_eval_split(recipe, run.tokenizer, _data_source(run, "eval_split")) if recipe.data.eval_split else None
    samples, held_out = training_and_held_out(recipe, samples, split)
    if held_out is None:
        return samples, None
    if not has_tokens(held_out):
        raise UsageError("the held-out set has no token to evaluate (every label is a prompt or padding)")
    earlier = None
    if p.is_global_zero and not run.args.fresh:
        earlier = read_events_dir(run.run_dir / "events").events  # this attempt's too (a restart in place)
        if run.tier is not None and all(e.get("attempt") == run.attempt for e in earlier):  # a new machine
            try:
                earlier = history() + earlier
            except Exception as err:  # noqa: BLE001 - without it a step may be evaluated once more
                say(f"the store's event history is unreadable ({err}); evaluations already done may run again")
        earlier = [e for e in earlier if e.get("type") in ("start", "eval")]
        earlier.sort(key=lambda e: (e.get("attempt") or 0, e.get("ts") or 0))
    earlier = run.comm.io_gather(earlier)[0] or []
    evaluator = build_evaluator(recipe, held_out, device=run.device, dp_rank=p.rank, dp_size=p.world_size,
                                emit=run.emit, is_writer=p.is_global_zero, history=earlier)
    if p.is_global_zero:
        say(f"eval: {len(held_out)} held-out sequences ({'data.eval_split' if split is not None else 'eval.fraction'}), "
            f"{evaluator.batches} micro-batch{'es' if evaluator.batches != 1 else ''} per rank"
            + (f"; {len(evaluator.done)} steps already evaluated, the last {max(evaluator.done)}" if evaluator.done else ""))
    return samples, evaluator


def _evaluate(run: Run, state, vote: Optional[Vote]) -> None:
    """Every rank: the evaluation due at this step boundary, if any (every_steps, every_seconds, the last
    step). Not while training through a notice window: that time is for steps and the save. A signal
    or notice during it abandons it, and this start ends here as at any step boundary; the next start,
    resumed from this step, evaluates it again (nothing of the abandoned one is recorded)."""
    from skyspot.trainer.evaluate import any_rank

    evaluator = run.evaluator
    now = vote.now if vote is not None else None
    if evaluator is None or run.notice is not None or not evaluator.due(
            state.step, now, final=state.step >= run.recipe.train.steps):
        return
    if evaluator.evaluate(run.engine, state.step, lambda: any_rank(run.watch.poll(), run.device), now) is not None:
        return
    after = _boundary(run)
    if after.emergency and not _train_through(run, state, after):
        if run.resumed is not None and run.resumed.state.step == state.step:  # nothing trained since the resume
            raise Preempted(state.step, f"preempted during the evaluation of step {state.step}, the step this start "
                                        "resumed from: nothing new to save")
        _emergency(run, state, after)
    if vote is not None:
        vote.checkpoint = vote.checkpoint or after.checkpoint  # a warning during the eval still checkpoints


# --------------------------------------------------------------------------- cleanup


def main(argv: Optional[list[str]] = None) -> int:
    """One start of the trainer; returns its exit code (exit_codes.py)."""
    return _main(argv)[0]


def process_main(argv: Optional[list[str]] = None) -> int:
    """`python -m skyspot.trainer`: the process's exit status, 0 for a final ending under a torchrun that
    would restart it (exit_codes.process_code); the exit record carries the code to the supervisor."""
    return process_code(*_main(argv))


def _main(argv: Optional[list[str]]) -> tuple[int, bool]:
    from skyspot.trainer.restart import settle

    args = parse_args(argv)
    watch = PreemptionWatch()
    watch.install()  # first: a SIGTERM during setup must not kill the process
    run: Optional[Run] = None
    code, reason, step, final = ERROR, "error", None, False
    try:
        args.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # checkpoints are the user's alone
        run = setup(args, watch)
        settle(run.generation)  # restart.py: the backoff, or end at once (preempted before, the budget spent)
        build(run)
        step = train(run)
        code, reason, final = COMPLETE, "training complete", True
    except BaseException as err:  # noqa: BLE001 - every ending gets its exit code and record
        from skyspot.errors import SkyspotError
        from skyspot.trainer.restart import RestartBudgetSpent, record_failure

        failed_at = time.time()
        code = code_for(err)
        final = code in FINAL or isinstance(err, RestartBudgetSpent)
        step = err.step if isinstance(err, Preempted) else (run.step if run else None)
        known = isinstance(err, SkyspotError)  # one line that says what to do; a bug gets its traceback
        reason = str(err) if code != ERROR or known else f"{type(err).__name__}: {err}"
        if code == ERROR and not known:
            traceback.print_exc()
        elif code != PREEMPTED and (run.placement.is_global_zero if run else os.environ.get("RANK", "0") == "0"):
            say(str(err))
        if not final:  # what the restarted generation reads to say what failed when (restart.py)
            record_failure(args.run_dir, run.placement.rank if run else int(os.environ.get("RANK") or 0), reason,
                           failed_at)
    finally:
        code = cleanup(run, args, code, reason, step)
        watch.uninstall()
    return code, final


def _close_uploader(run: Run, code: int) -> None:
    """Let the uploads finish as far as this ending allows, then sync the event files one last time.

    Complete: upload final/ (global rank 0) while the final checkpoint finishes in the background,
    both within durable.FINAL_UPLOAD_S. Preempted: until the emergency deadline. Otherwise briefly:
    the newest committed checkpoint is worth a try. Called after the ranks' last barrier, so no
    rank waits in a collective for the store.
    """
    from skyspot.trainer.durable import FINAL_UPLOAD_S

    if code == COMPLETE:
        deadline = time.monotonic() + FINAL_UPLOAD_S
        if run.final is not None and run.uploader.put_tree(run.final, "final", timeout=FINAL_UPLOAD_S):
            say(f"model uploaded to {run.tier.uri}/{run.run_id}/final")
        timeout = max(0.0, deadline - time.monotonic())
    elif code == PREEMPTED and run.upload_deadline is not None:
        timeout = max(0.0, run.upload_deadline - time.time())
        run.uploader.sync_events(run.run_dir / "events")  # the exit is in the bucket even if the VM goes now
    else:
        timeout = 10.0
    try:
        done = run.uploader.close(timeout=timeout, join_timeout=min(30.0, timeout + 5.0))
    except Exception as err:  # never let the store change the exit code
        say(f"closing the uploader failed: {err}")
        return
    if code == COMPLETE and not done:
        say(f"the final checkpoint is not durable in {run.tier.uri} (the store did not answer within "
            f"{timeout:.0f} s); it is in {run.run_dir / 'checkpoints'}")


def cleanup(run: Optional[Run], args: argparse.Namespace, code: int, reason: str, step: Optional[int]) -> int:
    """Close everything; record the exit code; keep ranks together on collective endings."""
    is_leader = run.placement.is_node_leader if run else os.environ.get("LOCAL_RANK", "0") == "0"
    if run is not None:
        if run.notice_watcher is not None:
            run.notice_watcher.stop()
        if run.ckpt is not None:
            # A normal ending waits for the last write; after an error, a peer may be gone.
            run.ckpt.close(timeout=None if code in (COMPLETE, PREEMPTED) else 10.0)
    if is_leader:
        try:
            write_exit_record(args.run_dir, code, reason=reason, attempt=run.attempt if run else None, step=step)
        except OSError as err:
            say(f"could not write the exit record: {err}")
    if run is not None:
        run.emit("exit", code=code, reason=reason, step=step, meaning=describe(code), where=run.placement.where)
        if code in (COMPLETE, PREEMPTED, NO_VALID_CHECKPOINT):
            # Every rank reached this ending together; none may exit first, or torchrun would
            # tear the others down mid-commit. On the I/O group: global rank 0 may still be writing
            # final/ (minutes for 70B), longer than the default group's timeout (comm.py).
            try:
                run.comm.io_barrier()
            except Exception:
                pass
        if run.metrics is not None:
            run.metrics.close(code)  # before the uploader's last sync, which takes the dashboards' files along
        if run.uploader is not None:
            _close_uploader(run, code)  # after the barrier: every local rank's exit event is on disk
        run.events.close()
        if run.lock is not None:
            run.lock.release()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    if code == PREEMPTED and (run is None or run.placement.is_global_zero):
        say(f"exit {code}: {reason}")
    return code
