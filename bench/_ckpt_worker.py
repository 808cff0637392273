"""Benchmarks 1 and 2 inside one trainer per rank: checkpoint stall, then an emergency checkpoint.

    torchrun --nproc_per_node 2 -m bench._ckpt_worker --run-dir DIR --repeats 5 [key=value ...]

Sets the trainer up exactly as `python -m skyspot.trainer tiny` does (loop.setup, loop.build:
same engine, same CheckpointManager), trains two steps so Adam's moments exist, then per round
(with a training step before each while steps are cheap, as in the loop), each measured on
every rank after a barrier and reported as the slowest rank's time:

- skyspot: `CheckpointManager.save` (the loop's call), after the previous write finished; the
  background write (torch.save, sha256, fsync, manifest, marker) is timed separately;
- sync: DeepSpeed's `save_checkpoint` with its default TorchCheckpointEngine on the same engine,
  then fsync of every file and the directory (as durable as skyspot's commit);
- floor: one `copy_` of every tensor DeepSpeed hands to its checkpoint engine into tensors
  allocated and touched beforehand (pinned on a GPU: the device-to-host copy floor).

Round 0 is the first checkpoint (the snapshot buffers are allocated then); the parent reports
rounds 1.. . Then the emergency path, unchanged: the real loop (`loop.train`) runs until rank 0
sends itself SIGTERM halfway through its first step; the loop finishes that step, every rank writes and
commits the emergency checkpoint, and the `emergency_checkpoint` event gives signal_to_commit_seconds.
Last, rank 0 measures the run directory's write bandwidth (write + fsync a file of the same size).
Rank 0 prints one `BENCH_JSON {...}` line. With BENCH_PROFILE_DIR set, each rank also writes
a cProfile of its skyspot saves (rounds 1..) there as save.rank<R>.prof.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

BIG = 10**9  # steps / interval so large that the loop never saves on its own
PROFILE_ENV = "BENCH_PROFILE_DIR"


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench._ckpt_worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after the first")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def _tensors(obj, out):
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out)
    return out


def _fsync_tree(directory: Path, rank: int, is_leader: bool) -> None:
    """fsync this rank's files (DeepSpeed names them by rank), the leader the rest and the directory."""
    from skyspot.trainer.files import fsync_dir

    for path in sorted(directory.iterdir()):
        if not path.is_file():
            continue
        mine = f"rank_{rank}_" in path.name
        anyones = "rank_" not in path.name
        if mine or (anyones and is_leader):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if is_leader:
        fsync_dir(directory)
        fsync_dir(directory.parent)


def main(argv=None) -> int:
    opts = _parse(sys.argv[1:] if argv is None else argv)
    from skyspot.trainer import loop
    from skyspot.trainer.exit_codes import ERROR, PREEMPTED, Preempted
    from skyspot.trainer.preemption import PreemptionWatch

    watch = PreemptionWatch()
    watch.install()
    args = loop.parse_args(
        [
            "tiny",
            "--run-dir",
            str(opts.run_dir),
            f"train.steps={BIG}",
            f"checkpoint.every_steps={BIG}",
            "checkpoint.keep=2",
            "train.log_every=1000000",
            *opts.overrides,
        ]
    )
    args.run_dir.mkdir(parents=True, exist_ok=True)
    run = loop.setup(args, watch)
    code, reason = ERROR, "benchmark failed"
    try:
        loop.build(run)
        result = measure(run, opts.repeats, loop, Preempted)
        if run.placement.is_global_zero:
            from bench._launch import emit_result

            emit_result(result)
        code, reason = PREEMPTED, "benchmark done"
    except Exception:
        traceback.print_exc()
    finally:
        loop.cleanup(run, args, code, reason, run.step)
        watch.uninstall()
    return 0 if code == PREEMPTED else 1


def measure(run, repeats: int, loop, Preempted) -> dict:
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    from skyspot.trainer.checkpoint import TrainState
    from skyspot.trainer.manifest import remove_checkpoint_dir

    engine, p = run.engine, run.placement
    samples = 0

    def train_step() -> float:
        nonlocal samples
        start = time.perf_counter()
        for indices in run.order.step_indices(samples):
            ids, labels = loop._batch(run, indices)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
        samples += run.order.global_batch
        return time.perf_counter() - start

    def slowest(seconds: float) -> float:
        out = [None] * p.world_size
        dist.all_gather_object(out, seconds)
        return max(out)

    step_seconds = [train_step() for _ in range(2)]
    ours = engine.checkpoint_engine
    sync_engine = TorchCheckpointEngine(engine._config)

    class Recorder(CheckpointEngine):
        """Keeps what DeepSpeed hands over, writes nothing: the state a checkpoint copies."""

        def __init__(self):
            super().__init__(None)
            self.dicts = []

        def create(self, info):
            pass

        def save(self, state_dict, path):
            self.dicts.append(state_dict)

        def load(self, path, map_location=None):
            raise NotImplementedError

        def commit(self, info):
            return True

        def preserves_storage_sharing(self):
            return False

    recorder = Recorder()
    engine.checkpoint_engine = recorder
    scratch = run.run_dir / "bench-scratch"
    engine.save_checkpoint(str(scratch), tag="record", client_state={}, save_latest=False)
    sources = _tensors(recorder.dicts, [])
    # On a GPU the floor is the device-to-host copy into pinned memory, as the snapshot's buffers are.
    pinned = torch.cuda.is_available()
    targets = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned) for t in sources]  # as BufferPool

    def copy_all() -> None:
        for dst, src in zip(targets, sources):  # noqa: F821 - both are deleted (line 234) only after the last call
            dst.copy_(src, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()

    for _ in range(2):  # touch every page of the destination
        copy_all()
    state_bytes = sum(t.numel() * t.element_size() for t in sources)
    engine.checkpoint_engine = ours

    rounds = {"skyspot": [], "sync": [], "floor": [], "write": [], "manager_blocked": []}
    profiler = None
    if os.environ.get(PROFILE_ENV):  # cProfile of skyspot's saves after the first, one file per rank
        import cProfile

        profiler = cProfile.Profile()
    node_bytes = 0
    step_between = max(step_seconds) < 1.0  # a step between checkpoints, as in the loop, where it is cheap
    for r in range(repeats + 1):
        if step_between:
            step_seconds.append(train_step())
        # skyspot: the loop's call; the previous write has finished (the manager would wait for it)
        run.ckpt.wait()
        dist.barrier()
        if profiler is not None and r > 0:
            profiler.enable()
        start = time.perf_counter()
        run.ckpt.save(1000 + r, TrainState(1000 + r, samples, 0, run.order.state(samples)), kind="requested")
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        rounds["skyspot"].append(slowest(elapsed))
        written = run.ckpt.wait()
        if written is None or not written.committed:
            raise RuntimeError(f"skyspot checkpoint not committed: {written}")
        rounds["write"].append(slowest(written.write_seconds))
        rounds["manager_blocked"].append(slowest(written.blocked_seconds))
        node_bytes = written.bytes or node_bytes

        # DeepSpeed's synchronous save on the same engine, then made durable
        engine.checkpoint_engine = sync_engine
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(str(scratch), tag=f"sync_{r}", client_state={}, save_latest=False)
        _fsync_tree(scratch / f"sync_{r}", p.local_rank, p.is_node_leader)
        dist.barrier()
        rounds["sync"].append(slowest(time.perf_counter() - start))
        engine.checkpoint_engine = ours
        if p.is_node_leader:
            shutil.rmtree(scratch / f"sync_{r}", ignore_errors=True)

        # floor: one copy into buffers that already exist
        dist.barrier()
        start = time.perf_counter()
        copy_all()
        rounds["floor"].append(slowest(time.perf_counter() - start))
    del targets, sources, recorder.dicts
    if profiler is not None:
        profiler.dump_stats(Path(os.environ[PROFILE_ENV]) / f"save.rank{p.rank}.prof")

    # Leave only what the emergency save needs: no checkpoints, nothing in flight.
    dist.barrier()
    if p.is_node_leader:
        for path in run.ckpt.root.glob("step_*"):
            remove_checkpoint_dir(path)
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    run.ckpt.last_committed = None

    emergency = _emergency(run, loop, Preempted, step_seconds)

    bandwidth = None
    if p.is_node_leader:
        from bench._launch import disk_bandwidth

        bandwidth = disk_bandwidth(run.run_dir, max(node_bytes, 64 << 20))
    dist.barrier()
    return {
        "params": sum(int(getattr(q, "ds_numel", q.numel())) for q in engine.module.parameters()),
        "state_bytes_rank0": state_bytes,
        "node_bytes": node_bytes,
        "step_seconds": step_seconds,
        "rounds": rounds,
        "emergency": emergency,
        "write_bps": bandwidth[0] if bandwidth else None,
        "read_bps": bandwidth[1] if bandwidth else None,
    }


def _emergency(run, loop, Preempted, step_seconds: list[float]) -> dict:
    """The real loop until rank 0's SIGTERM in the middle of its first step; the trainer's own event."""
    from bench._launch import events

    typical = sorted(step_seconds)[len(step_seconds) // 2]
    sent = {}
    if run.placement.is_global_zero:

        def send():
            while run.step is None:  # train() sets it just before the first step
                time.sleep(0.001)
            time.sleep(typical / 2)
            sent["ts"] = time.time()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=send, daemon=True).start()
    try:
        loop.train(run)
        raise RuntimeError("the loop ended without an emergency checkpoint")
    except Preempted:
        pass
    if not run.placement.is_global_zero:
        return {}
    found = events(run.run_dir, "emergency_checkpoint")
    if not found:
        raise RuntimeError("no emergency_checkpoint event")
    return {**found[-1], "signal_sent": sent.get("ts"), "typical_step_seconds": typical}


if __name__ == "__main__":
    sys.exit(main())
