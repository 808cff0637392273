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
What a start holds is declared in phases.py (after setup, after build, while training); resume.py,
vote.py (the step boundary) and notice_window.py (training through a notice) hold the parts this
file calls in the order it runs (as nanoGPT's train.py); process_env.py the environment, read once.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from skyspot import hub
from skyspot.errors import SkyspotError, StoreError, UsageError
from skyspot.events import CheckpointKind as Kind, EventWriter
from skyspot.recipe import Recipe, load_recipe
from skyspot.start_bounds import start_bounds
from skyspot.trainer import cluster, fabric, fence, process_env, restart
from skyspot.trainer import instance as node_instance
from skyspot.trainer.base import BaseModel
from skyspot.trainer.checkpoint import CheckpointManager, TrainState, resharding
from skyspot.trainer.data import DataOrder, build_dataset
from skyspot.trainer.durable import FINAL_UPLOAD_S, Probe, StoreTier, emergency_deadline, restore_run_json
from skyspot.trainer.evaluate import any_rank
from skyspot.trainer.exit_codes import (
    COMPLETE,
    ERROR,
    FINAL,
    NO_VALID_CHECKPOINT,
    PREEMPTED,
    Preempted,
    Superseded,
    code_for,
    describe,
    process_code,
    write_exit_record,
)
from skyspot.trainer.ext_lock import clear_stale
from skyspot.trainer.faults import fault_point
from skyspot.trainer.gpu import require_cuda
from skyspot.trainer.lean_imports import import_deepspeed
from skyspot.trainer.local_disk import record_event
from skyspot.trainer.metrics import attach as attach_metrics
from skyspot.trainer.node_facts import collect as node_facts
from skyspot.trainer.notice_window import train_through, window_fields
from skyspot.trainer.phases import Built, Run, Started
from skyspot.trainer.preemption import NoticeFile, PreemptionWatch, SavePredictor
from skyspot.trainer.resume import (
    apply_schedule,
    data_source,
    held_out,
    keep_global_batch,
    reconcile_recipe,
    seed_predictor,
    store_history,
)
from skyspot.trainer.rundir import RunLock, move_aside, next_attempt, record_attempt, write_run_json
from skyspot.trainer.say import say
from skyspot.trainer.stacks import allow_stack_dumps
from skyspot.trainer.vote import Vote, boundary

__all__ = [
    "Run",
    "build",
    "cleanup",
    "main",
    "parse_args",
    "probe_fabric",
    "process_main",
    "reconcile_recipe",
    "setup",
    "train",
]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m skyspot.trainer",
        description="Train a recipe with DeepSpeed ZeRO-3; resume automatically from DIR/checkpoints.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="registry name (e.g. tiny) or a recipe file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="recipe overrides, e.g. train.steps=40 storage.store=s3://bucket/prefix",
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="the run's local directory (fast tier)")
    parser.add_argument(
        "--run-name", default=None, help="run id (default: SKYSPOT_RUN_NAME, SKYPILOT_TASK_ID, DIR's name)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0: earlier checkpoints and final/ are moved to DIR/superseded/",
    )
    return parser.parse_intermixed_args(argv)


# --------------------------------------------------------------------------- setup


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    # Lazy: DeepSpeed loads only after setup's GPU check (it would pick its CPU accelerator; gpu.py),
    # and without what the trainer never runs (lean_imports.py).
    import_deepspeed()
    import deepspeed.utils.logging as ds_logging

    ds_logging.logger.setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def setup(args: argparse.Namespace, watch: PreemptionWatch) -> Run:
    process_env.die_with_parent()
    allow_stack_dumps(args.run_dir)  # the supervisor's watchdog may read this rank's stacks (stacks.py)
    env = process_env.start()  # the only changes to os.environ, before anything reads it (process_env.py)
    placement = cluster.from_environment()
    # Before anything else, DeepSpeed's import included (it would pick its CPU accelerator): a node
    # that was given GPUs trains on them or not at all (gpu.py; exit 2, only the exit record written).
    require_cuda(env.local_world_size)
    # Shutdown warnings are watched from here, before the slow part of setup and the model load:
    # Azure turns Scheduled Events on at the first request and delivers events minutes later, so an
    # attempt's first minutes are covered only if that request goes out now (notice.py).
    notice_watcher = _start_notice_watcher(watch) if placement.is_node_leader else None
    recipe = load_recipe(args.recipe, args.overrides)
    _check_local_paths(recipe)  # before the slow imports: a missing directory is one line in a second

    if placement.is_node_leader:  # before any rank loads an op: a killed build's lock would hang them all
        clear_stale(say=say)
    _quiet_libraries()
    # Lazy, here and below: torch and DeepSpeed load after the GPU check and the notice watcher's start
    # above (seconds of imports; comm and determinism import torch).
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from skyspot.trainer.comm import Comm
    from skyspot.trainer.determinism import configure_threads

    threads = configure_threads(placement.local_world_size)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(placement.local_rank)
    timeout = env.dist_timeout
    backend = accelerator.communication_backend_name()
    # Before NCCL starts: the node leader's NCCL says which transport it chose (the `fabric` event).
    nccl_log = fabric.prepare(args.run_dir, backend=backend, node_leader=placement.is_node_leader)
    cluster.init_process_group(backend, timeout)  # the pinned ranks; else DeepSpeed's env:// below
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    comm = Comm(start_bounds(recipe).io_seconds)  # the I/O group waits as long as this recipe's download may take
    device = torch.device(accelerator.current_device_name())
    run_id = cluster.run_id(args.run_name, args.run_dir, env.environ)

    # One trainer per run directory: a second start while one runs would write beside it.
    lock = RunLock(args.run_dir) if placement.is_node_leader else None
    holder = lock.acquire() if lock is not None else None
    holders = [h for h in comm.all_gather_object(holder) if h]
    if holders:
        raise UsageError(f"{args.run_dir} is in use by another trainer ({holders[0]}); one trainer per run directory")

    # A restart in place (torchrun restarted the workers) continues the attempt: same number, no --fresh.
    generation = restart.begin(args.run_dir, placement, comm, recipe.resilience, say)
    fresh = bool(args.fresh) and not generation.in_place

    # The store, asked once by global rank 0 (attempt counter, durable checkpoints, run.json).
    store_uri = recipe.storage.store
    tier, probe = None, None
    if store_uri:
        try:
            tier = StoreTier(store_uri, run_id, placement, warn=say)
        except StoreError as err:  # a backend that cannot be opened
            raise UsageError(str(err)) from None
        if placement.rank == 0:
            probe = tier.probe(fresh=fresh, count=not generation.in_place)
        probe = comm.io_gather(probe)[0] or Probe()  # the probe retries a slow store for ~30 s
        if probe.usage_error:
            raise UsageError(probe.usage_error)
        if probe.warning and placement.is_global_zero:
            say(probe.warning)
        tier.adopt(probe)
        # The attempt's epoch in the run's fence (fence.py): taken by this start's probe, else kept by the
        # workers of a restart in place, else (the store unreachable at the start) joined at the first commit.
        if probe.epoch is None and generation.in_place:
            tier.epoch = fence.remembered(args.run_dir)

    if fresh and placement.is_node_leader:
        moved = move_aside(args.run_dir)
        say(
            f"--fresh: moved earlier checkpoints and final/ to {moved}; starting from step 0"
            if moved
            else "--fresh: nothing to move aside; starting from step 0"
        )
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
    uploader = None
    if placement.is_node_leader:
        if probe is not None:
            restore_run_json(args.run_dir, probe, fresh)
        _, warning = write_run_json(
            args.run_dir,
            run_id=run_id,
            recipe=recipe,
            store=store_uri,
            world_size=placement.world_size,
            where=placement.where,
            fresh=fresh,
        )
        if warning and placement.is_global_zero:
            say(warning)
        if tier is not None:
            if probe is not None and probe.epoch is not None:
                fence.remember(args.run_dir, probe.epoch)  # for the workers of a restart in place
            uploader = tier.uploader(events, args.run_dir, recipe.checkpoint.keep)
            if placement.is_global_zero and probe.attempt is not None and (fresh or probe.run_json is None):
                uploader.sync_small(args.run_dir / "run.json", "run.json")
    started = Started(
        args=args,
        env=env,
        recipe=recipe,
        placement=placement,
        run_id=run_id,
        attempt=attempt,
        fresh=fresh,
        events=events,
        comm=comm,
        watch=watch,
        device=device,
        generation=generation,
        lock=lock,
        tier=tier,
        uploader=uploader,
        notice_watcher=notice_watcher,
    )
    if placement.is_global_zero and recipe.metrics.backends:  # from here on its events reach the dashboards
        started = replace(started, metrics=attach_metrics(started, say))
    # The node leader asks its cloud's metadata what it runs on (SkyPilot does not say instance or spot).
    found = node_instance.read(env.environ) if placement.is_node_leader else None
    where = node_instance.where_with(placement.where, found)
    started = replace(started, backend=backend, nccl_log=nccl_log, where=where)  # the fabric probe's (probe_fabric)
    started.emit(
        "start",
        where=where,
        world_size=placement.world_size,
        total_steps=recipe.train.steps,
        recipe=recipe.name,
        pid=os.getpid(),
        fingerprint=recipe.fingerprint(),
        threads=threads,
        store=store_uri,
        fresh=fresh,
        **({"instance": found} if found else {}),
    )
    if placement.is_node_leader:
        record_event(args.run_dir, events)  # the node's local NVMe as setup measured it (local_disk.py)
        try:  # what this node is: image, Python, driver, torch, NCCL file, GPUs, fabric (node_facts.py)
            events.emit("node", **node_facts(env.environ, instance=found, run_dir=args.run_dir))
        except Exception as error:  # noqa: BLE001 - a fact that cannot be read never fails a start
            say(f"node facts not read: {error}")
    return Run(started)


def probe_fabric(run: Run) -> None:
    """After the rendezvous, before the model: every rank all-reduces the probe's buffer (fabric_probe.py),
    each node leader records the `fabric` event (transport, bus bandwidth, what its instance type should
    carry; fabric.py), and with `fabric.require: best` a short fabric on any node ends the start on every
    rank with that node's one line (UsageError: exit 2, not restarted in place or by the local executor)."""
    from skyspot.trainer import fabric_probe

    started = run.started
    placement, settings, backend = started.placement, started.recipe.fabric, started.backend
    size = fabric_probe.probe_bytes(settings.probe_mib, backend)
    probed = fabric_probe.measure(size, started.device)  # a collective: every rank, the same size
    refusal = None
    if placement.is_node_leader:
        fields = fabric.record(
            started.nccl_log,
            backend=backend,
            num_nodes=placement.num_nodes,
            events=started.events,
            say=say,
            probe=probed.fields() if probed else None,
            where=started.where,
            require=settings.require,
        )
        refusal = fields.get("refused")
    refusals = [line for line in started.comm.all_gather_object(refusal) if line]
    if refusals:
        raise UsageError(refusals[0])


def _check_local_paths(recipe: Recipe) -> None:
    """A local model directory, tokenizer directory or data file that is not on this node (UsageError)."""
    model = recipe.model
    if model.is_local:
        hub.check_local_model(model.hub_id)
    if model.tokenizer not in (None, "bytes", model.hub_id) and hub.is_local_ref(model.tokenizer):
        hub.check_local_tokenizer(model.tokenizer)
    source = recipe.data.source
    if "://" not in source and source != "synthetic" and not Path(os.path.expanduser(source)).is_file():
        raise UsageError(f"data.source '{source}' is not 'synthetic', hf://org/name, or an existing file")
    kept_out = recipe.data.eval_split
    if kept_out and not source.startswith("hf://") and "://" not in kept_out and not Path(kept_out).is_file():
        raise UsageError(
            f"data.eval_split '{kept_out}' is not an existing file (a second file of data.source's format)"
        )


def _start_notice_watcher(watch: PreemptionWatch):
    """The node leader's notices (notice.py), which then reach every rank through the step-boundary
    vote. Under the node's supervisor the watcher runs there, since before torchrun, and this only
    reads the supervisor's notice file at each step boundary (preemption.NoticeFile): no thread here
    competes with training. Started without the supervisor, the node leader runs the watcher itself.
    A preemption, or a planned shutdown close to its deadline, is an emergency; a planned shutdown
    ahead of time, a rebalance recommendation or a harmless maintenance event is an early
    checkpoint, and training goes on."""
    env = process_env.read()  # as setup's process_env.start() left it
    if env.notice_file:
        watch.follow(NoticeFile(Path(env.notice_file), env.supervisor_token))
        return None
    try:  # lazy and guarded: a node whose notice package cannot load still trains (signals, intervals)
        from skyspot.trainer.notice import watch_for
    except ImportError:
        return None
    return watch_for(watch)


# --------------------------------------------------------------------------- resume


def build(run: Run) -> None:
    """Find the resume point, then build data, model and engine, and restore the state."""
    # Lazy: these import torch (and DeepSpeed), which setup loaded after its GPU check.
    from skyspot.trainer.determinism import seed_everything
    from skyspot.trainer.engine import deepspeed_config, initialize
    from skyspot.trainer.model import build_model, load_tokenizer, trainable_count

    started = run.started
    p = started.placement
    history = store_history(started)
    predictor = SavePredictor(store=started.uploader is not None)
    store_hooks = {}
    if started.uploader is not None:
        store_hooks = dict(
            on_committed=[started.uploader.submit],  # from the writer thread: only enqueues
            can_delete=[started.uploader.can_delete_local],  # answered from memory
            stream_sink=started.uploader,
        )  # told which files the writers streamed to the store
    ckpt = run.ckpt = CheckpointManager(
        started.run_dir,
        p,
        started.recipe,
        run_id=started.run_id,
        attempt=started.attempt,
        events=started.events if p.is_global_zero else None,
        comm=started.comm,
        warn=say,
        resume_source=started.tier,
        predictor=predictor,
        history=history,
        **store_hooks,
    )
    cfg = started.recipe.checkpoint
    if p.is_global_zero and started.tier is not None and (cfg.every_seconds == "auto" or cfg.train_through_notice):
        try:
            history()  # read now, while the other ranks wait on the I/O group in find(), not in the first vote
        except Exception:  # noqa: BLE001 - advice only; read again (and reported) where it is used
            pass
    point = ckpt.find()
    resharded = point is not None and resharding(point.manifest, p.world_size, p.num_nodes)
    recipe = started.recipe
    if point is not None:
        recipe, lines = reconcile_recipe(recipe, point.manifest.get("recipe"))
        if resharded:
            recipe, note = keep_global_batch(recipe, point.manifest, p.world_size)
            lines += [note] if note else []
        if p.is_global_zero:
            for line in lines:
                say(line)

    # Config and tokenizer first, then the data: a data set the format cannot read fails here, before
    # any weights move. The weights only where they are needed: a fresh start, or LoRA's frozen base
    # (a resumed full fine-tune gets every parameter from the checkpoint).
    base = BaseModel(recipe, started.run_dir, p, started.comm, tier=started.tier, emit=started.emit, say=say)
    base.prepare(weights=False)
    tokenizer = load_tokenizer(recipe.model, base.path)
    samples = build_dataset(recipe, tokenizer, data_source(started, recipe))
    if p.is_global_zero and samples.examples:
        dropped = f"; {samples.dropped} left out (nothing to train on within seq_len)" if samples.dropped else ""
        say(
            f"data: {samples.examples} examples ({recipe.data.format}) -> {len(samples)} sequences of "
            f"{recipe.train.seq_len} tokens ({'packed' if recipe.data.packing else 'padded'}){dropped}"
        )
    samples, evaluator = held_out(started, recipe, tokenizer, samples, history)
    order = DataOrder(
        len(samples),
        recipe.train.seed,
        recipe.data.shuffle,
        p.rank,
        p.world_size,
        recipe.train.micro_batch_size,
        recipe.train.grad_accum,
    )
    weights = recipe.model.hub_id is not None and (point is None or recipe.train.lora is not None)
    if weights:
        base.prepare(weights=True)

    ds_config = deepspeed_config(recipe)
    if resharded:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True  # reshard.py
    seed_everything(recipe.train.seed)  # the same initial weights on every rank, every start
    model, keepalive = build_model(recipe, ds_config, tokenizer, base.path, load_weights=weights)
    if recipe.train.lora is not None and p.is_global_zero:
        trainable, total = trainable_count(model)
        say(
            f"LoRA r={recipe.train.lora.r} on {', '.join(recipe.train.lora.target_modules)}: {trainable:,} of "
            f"{total:,} parameters trainable ({trainable / max(1, total):.2%})"
        )
    engine = initialize(recipe, model, ds_config)
    if weights:
        base.start_copy()

    resumed = ckpt.load(point, engine)  # and plans the interval (every_seconds=auto)
    seed_predictor(started, recipe, predictor, history)
    if resumed is None:
        seed_everything(recipe.train.seed + 1000 * p.rank)  # dropout etc. differ per rank
    else:
        apply_schedule(engine, recipe)
        if point.manifest.get("data", {}).get("num_samples") not in (None, len(samples)) and p.is_global_zero:
            say(
                f"the data set has {len(samples)} samples, the checkpoint's had "
                f"{point.manifest['data']['num_samples']}: the order continues by position, not by sample"
            )
        if p.is_global_zero:
            s = resumed.state
            say(f"resumed from {point.path} (step {s.step}, {s.samples} samples) in {resumed.load_seconds:.2f} s")
    if p.is_global_zero and started.generation is not None:
        restart.resumed(started.generation, resumed.state.step if resumed else 0)
    run.built = Built(
        recipe=recipe,
        ckpt=ckpt,
        base=base,
        tokenizer=tokenizer,
        samples=samples,
        order=order,
        evaluator=evaluator,
        keepalive=keepalive,
        engine=engine,
        resumed=resumed,
        predictor=predictor,
    )


# --------------------------------------------------------------------------- loop


def _batch(run: Run, indices) -> tuple[Any, Any]:
    """Token ids and labels (-100 where there is no loss: prompts, padding) of these samples."""
    import torch  # lazy: loaded by setup after its GPU check

    samples, device = run.trained.samples, run.started.device
    ids = torch.from_numpy(samples.ids[indices]).to(device)
    labels = torch.from_numpy(samples.labels[indices]).to(device)
    return ids, labels


def train(run: Run) -> int:
    """The loop. Returns the final step when training is complete; raises Preempted after an emergency save."""
    built, progress = run.trained, run.progress
    recipe, engine, order = built.recipe, built.engine, built.order
    total = recipe.train.steps
    state = built.resumed.state if built.resumed else TrainState(0, 0, 0, order.state(0))
    progress.step = state.step

    vote = boundary(run)  # a signal during setup still gets its (trivial) emergency exit
    _stop_if_stale(state.step, vote)
    if vote.emergency and not train_through(run, state, vote):
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
        progress.step = state.step
        fault_point("step_end", state.step)
        vote = boundary(run, sum(losses) / len(losses), tokens, step_seconds)
        _stop_if_stale(state.step, vote)
        state.tokens += vote.tokens
        state.data = order.state(state.samples)
        step_seconds = time.perf_counter() - start
        built.ckpt.poll()
        norm = engine.get_global_grad_norm()  # rank 0's copy of the global norm (DeepSpeed), for the dashboards
        run.emit(
            "step",
            step=state.step,
            loss=vote.loss,
            lr=lr,
            step_seconds=round(step_seconds, 6),
            samples=state.samples,
            tokens=state.tokens,
            sync_seconds=round(vote.seconds, 6),
            grad_norm=None if norm is None else float(norm),
        )
        restart.first_step(run.started.generation, run.emit, say)  # after a restart in place: its event (restart.py)
        if run.placement.is_global_zero and (state.step % recipe.train.log_every == 0 or state.step == total):
            print(
                f"step {state.step}/{total} | loss {vote.loss:.4f} | lr {lr:.3e} | "
                f"{step_seconds * 1000:.0f} ms/step | {vote.tokens / step_seconds:.0f} tok/s",
                flush=True,
            )

        if vote.emergency and not train_through(run, state, vote):
            _emergency(run, state, vote)
        _evaluate(run, state, vote)
        if state.step == total:
            break
        notice = progress.notice
        early = notice is not None and notice.take_checkpoint_now()  # a notice, nothing measured
        if early or notice is None:
            built.ckpt.save(
                state.step,
                state,
                kind=Kind.REQUESTED if early or vote.checkpoint else Kind.INTERVAL,
                time_due=vote.time_due,
            )

    # ------------------------------------------------------------------ save (complete)
    _finish(run, state)
    return state.step


def _stop_if_stale(step: int, vote: Vote) -> None:
    """Every rank, on the same vote: a newer attempt holds the store, so nothing this one writes counts
    (fence.py); stop at once, no checkpoint (it would be refused), and exit STALE."""
    if vote.stale:
        raise Superseded(step, vote.stale)  # said once, by global rank 0, as every ending is (main)


def _emergency(run: Run, state: TrainState, vote: Vote) -> None:
    """Every rank: commit an emergency checkpoint of this step together, push it to the store as far
    as the deadline allows, then unwind to exit 75."""
    built, progress, uploader = run.trained, run.progress, run.started.uploader
    if state.step == 0 and built.resumed is None:
        raise Preempted(0, "preempted before the first step: nothing to save")
    progress.upload_deadline = emergency_deadline(vote.deadline, vote.first_seen, run.placement.where.get("cloud"))
    if uploader is not None:
        uploader.set_deadline(progress.upload_deadline)  # before the commit hook submits the emergency step
    save_started = time.time()
    result = built.ckpt.save(state.step, state, kind=Kind.EMERGENCY, deadline=progress.upload_deadline, blocking=True)
    committed = result is not None and result.committed
    durable, newest_durable = _push_before_deadline(run, state.step, committed)
    safe_at = time.time()
    if committed:
        first = vote.first_seen or result.committed_at
        run.emit(
            "emergency_checkpoint",
            step=state.step,
            signal_to_commit_seconds=round(result.committed_at - first, 6),
            durable_before_deadline=durable,
            newest_durable_step=newest_durable,
            deadline=vote.deadline,
            upload_deadline=round(progress.upload_deadline, 3),
            committed_before_deadline=None if vote.deadline is None else result.committed_at <= vote.deadline,
            write_seconds=round(result.write_seconds, 6),
            blocked_seconds=round(result.blocked_seconds, 6),
            bytes=result.bytes,
            **window_fields(run, state.step, vote, save_started, safe_at, durable),
        )
        raise Preempted(
            state.step,
            f"preempted: emergency checkpoint step_{state.step} committed"
            + ("" if durable is None else " and durable" if durable else ", not durable in the store"),
        )
    raise Preempted(
        state.step,
        f"preempted: emergency checkpoint failed ({result.error if result else 'no result'}); "
        f"resume from step_{built.ckpt.last_committed}",
    )


def _push_before_deadline(run: Run, step: int, committed: bool) -> tuple[Optional[bool], Optional[int]]:
    """Every rank (collective when there is a store): did every node get its part of `step` into the
    store before the deadline, and which is the newest checkpoint every node has there?"""
    started = run.started
    if started.tier is None:
        return None, None
    mine = None
    if started.uploader is not None:
        uploaded = started.uploader.flush_until(run.progress.upload_deadline) if committed else False
        have = set(started.uploader.durable_steps()) | {s for s in (step,) if uploaded}
        mine = (uploaded, sorted(have))
    views = [v for v in started.comm.io_gather(mine) if v is not None]  # uploads until the deadline
    durable = committed and bool(views) and all(v[0] for v in views)
    common = set.intersection(*(set(v[1]) for v in views)) if views else set()
    return durable, (max(common) if common else None)


def _finish(run: Run, state: TrainState) -> None:
    """Training complete: a final checkpoint (so a restart knows), then final/."""
    from skyspot.trainer.export import export_final  # lazy: imports torch, loaded by setup after its GPU check

    built = run.trained
    _evaluate(run, state, None)  # resumed at the last step with its eval missing
    if built.ckpt.last_committed != state.step:
        result = built.ckpt.save(state.step, state, kind=Kind.FINAL, blocking=True)
        if result is None or not result.committed:
            raise SkyspotError(
                f"the final checkpoint step_{state.step} could not be written "
                f"({result.error if result else 'no result'}); the next start resumes from "
                f"step_{built.ckpt.last_committed} once {run.run_dir} has room"
            )
    target = export_final(
        built.engine,
        built.tokenizer,
        run.run_dir,
        is_writer=run.placement.is_global_zero,
        merge=built.recipe.export.merge,
        step=state.step,
        evaluation=built.evaluator.last if built.evaluator is not None else None,
    )
    if target is not None:
        say(f"training complete at step {state.step}; model written to {target}")
        run.progress.final = (
            target  # uploaded in cleanup, after the ranks' barrier: no rank waits in a collective for it
        )


# --------------------------------------------------------------------------- evaluation


def _evaluate(run: Run, state: TrainState, vote: Optional[Vote]) -> None:
    """Every rank: the evaluation due at this step boundary, if any (every_steps, every_seconds, the last
    step). Not while training through a notice window: that time is for steps and the save. A signal
    or notice during it abandons it, and this start ends here as at any step boundary; the next start,
    resumed from this step, evaluates it again (nothing of the abandoned one is recorded)."""
    built, started = run.trained, run.started
    evaluator = built.evaluator
    now = vote.now if vote is not None else None
    if (
        evaluator is None
        or run.progress.notice is not None
        or not evaluator.due(state.step, now, final=state.step >= built.recipe.train.steps)
    ):
        return
    if (
        evaluator.evaluate(built.engine, state.step, lambda: any_rank(started.watch.poll(), started.device), now)
        is not None
    ):
        return
    after = boundary(run)
    if after.emergency and not train_through(run, state, after):
        if built.resumed is not None and built.resumed.state.step == state.step:  # nothing trained since the resume
            raise Preempted(
                state.step,
                f"preempted during the evaluation of step {state.step}, the step this start "
                "resumed from: nothing new to save",
            )
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
    args = parse_args(argv)
    watch = PreemptionWatch()
    watch.install()  # first: a SIGTERM during setup must not kill the process
    run: Optional[Run] = None
    code, reason, step, final = ERROR, "error", None, False
    try:
        args.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # checkpoints are the user's alone
        run = setup(args, watch)
        restart.settle(
            run.started.generation
        )  # restart.py: the backoff, or end at once (preempted before, the budget spent)
        probe_fabric(run)  # what the fabric carries, before the model is built; `fabric.require: best` may refuse
        build(run)
        step = train(run)
        code, reason, final = COMPLETE, "training complete", True
    except BaseException as err:  # noqa: BLE001 - every ending gets its exit code and record
        failed_at = time.time()
        code = code_for(err)
        final = code in FINAL or isinstance(err, restart.RestartBudgetSpent)
        step = err.step if isinstance(err, (Preempted, Superseded)) else (run.step if run else None)
        known = isinstance(err, SkyspotError)  # one line that says what to do; a bug gets its traceback
        reason = str(err) if code != ERROR or known else f"{type(err).__name__}: {err}"
        if code == ERROR and not known:
            traceback.print_exc()
        elif code != PREEMPTED and (run.placement.is_global_zero if run else process_env.read().is_global_zero):
            say(str(err))
        if not final:  # what the restarted generation reads to say what failed when (restart.py)
            restart.record_failure(
                args.run_dir, run.placement.rank if run else process_env.read().rank, reason, failed_at
            )
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
    started, progress = run.started, run.progress
    uploader, tier = started.uploader, started.tier
    if code == COMPLETE:
        deadline = time.monotonic() + FINAL_UPLOAD_S
        if progress.final is not None and uploader.put_tree(progress.final, "final", timeout=FINAL_UPLOAD_S):
            say(f"model uploaded to {tier.uri}/{started.run_id}/final")
        timeout = max(0.0, deadline - time.monotonic())
    elif code == PREEMPTED and progress.upload_deadline is not None:
        timeout = max(0.0, progress.upload_deadline - time.time())
        uploader.sync_events(run.run_dir / "events")  # the exit is in the bucket even if the VM goes now
    else:
        timeout = 10.0
    try:
        done = uploader.close(timeout=timeout, join_timeout=min(30.0, timeout + 5.0))
    except Exception as err:  # never let the store change the exit code
        say(f"closing the uploader failed: {err}")
        return
    if code == COMPLETE and not done:
        say(
            f"the final checkpoint is not durable in {tier.uri} (the store did not answer within "
            f"{timeout:.0f} s); it is in {run.run_dir / 'checkpoints'}"
        )


def cleanup(run: Optional[Run], args: argparse.Namespace, code: int, reason: str, step: Optional[int]) -> int:
    """Close everything; record the exit code; keep ranks together on collective endings."""
    is_leader = run.placement.is_node_leader if run else process_env.read().is_node_leader
    started = run.started if run is not None else None
    if run is not None:
        if started.notice_watcher is not None:
            started.notice_watcher.stop()
        if run.ckpt is not None:
            # A normal ending waits for the last write; after an error, a peer may be gone.
            run.ckpt.close(timeout=None if code in (COMPLETE, PREEMPTED) else 10.0)
    if is_leader:
        try:
            write_exit_record(args.run_dir, code, reason=reason, attempt=started.attempt if run else None, step=step)
        except OSError as err:
            say(f"could not write the exit record: {err}")
    if run is not None:
        run.emit("exit", code=code, reason=reason, step=step, meaning=describe(code), where=run.placement.where)
        if code in (COMPLETE, PREEMPTED, NO_VALID_CHECKPOINT):
            # Every rank reached this ending together; none may exit first, or torchrun would
            # tear the others down mid-commit. On the I/O group: global rank 0 may still be writing
            # final/ (minutes for 70B), longer than the default group's timeout (comm.py).
            try:
                started.comm.io_barrier()
            except Exception:
                pass
        if started.metrics is not None:
            started.metrics.close(code)  # before the uploader's last sync, which takes the dashboards' files along
        if started.uploader is not None:
            _close_uploader(run, code)  # after the barrier: every local rank's exit event is on disk
        started.events.close()
        if started.lock is not None:
            started.lock.release()
        try:
            import torch.distributed as dist  # lazy: torch is loaded by now; a failed setup may not have

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    if code == PREEMPTED and (run is None or run.placement.is_global_zero):
        say(f"exit {code}: {reason}")
    return code
