"""Resume at a different world size: a ZeRO-3 checkpoint written by N ranks, loaded by M.

ZeRO-3 shards every parameter and its optimizer state across the ranks that wrote it, so the
files of N ranks cannot be loaded by M != N ranks as they are. DeepSpeed's universal checkpoint
(`deepspeed.checkpoint.ds_to_universal`) merges them into one file per parameter and state
(fp32, exp_avg, exp_avg_sq) that any world size can load (`"checkpoint": {"load_universal": true}`).

    run_dir/universal/step_<N>/        the converted checkpoint, the node's cache
        zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt, zero/optimizer_state.pt
        zero_pp_rank_<R>_mp_rank_00_model_states.pt   (copied: global step, LR scheduler)
        CONVERTED                       {"step", "manifest_sha256"} of the source, written last

A node converts a step once: the cache is reused while its CONVERTED names the same source
manifest, and a conversion for another step replaces it (one cache per node, the size of one
checkpoint). A conversion cut short leaves a hidden `.step_<N>.partial-*` directory that the
next conversion removes; it is never read.

What else changes with the world size (checkpoint.py and data.py apply it):
- the global batch is kept: micro batch and gradient accumulation are re-split
  (data.rebatch), so every step takes the same samples from the stream as before, the
  learning-rate schedule continues by step, and no sample is skipped or repeated;
- the per-rank RNG states cannot be mapped onto other ranks: each rank is re-seeded from
  (train.seed, rank, step) (determinism.seed_for_resume).

All ranks of the source must be present in the node's directory of the step; a checkpoint
written by several nodes is completed from the store first (`gather`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Optional

from skyspot.errors import CheckpointError
from skyspot.trainer import manifest as mf
from skyspot.trainer import safe_load
from skyspot.trainer.files import write_durably

UNIVERSAL_DIR = "universal"
CONVERTED = "CONVERTED"
_OPTIM = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def universal_root(run_dir: Path) -> Path:
    return Path(run_dir) / UNIVERSAL_DIR


def ranks_present(step_dir: Path) -> set[int]:
    """The ranks whose optimizer shard is in `step_dir`."""
    try:
        names = os.listdir(step_dir)
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for n in names if (m := _OPTIM.match(n))}


def manifest_sha256(step_dir: Path) -> str:
    return mf.sha256_bytes((Path(step_dir) / mf.MANIFEST).read_bytes())


def cached(run_dir: Path, step: int, source_sha256: str) -> Optional[Path]:
    """The converted directory of `step` when it was made from this very source, else None."""
    target = universal_root(run_dir) / mf.step_dir_name(step)
    try:
        record = json.loads((target / CONVERTED).read_text())
    except (OSError, ValueError):
        return None
    if record.get("step") == step and record.get("manifest_sha256") == source_sha256:
        return target
    return None


def convert(source: Path, run_dir: Path, step: int, source_sha256: str, *, workers: int = 1) -> Path:
    """Convert the checkpoint in `source` (every rank's files) into run_dir/universal/step_<N>/.

    Raises CheckpointError with one line when DeepSpeed cannot convert it.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    root = universal_root(run_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    keep = Path(source).resolve()
    for stale in root.iterdir():  # one cache per node: an older conversion or a cut one goes
        if stale.is_dir() and stale.resolve() != keep:
            shutil.rmtree(stale, ignore_errors=True)
    partial = root / f".{mf.step_dir_name(step)}.partial-{uuid.uuid4().hex[:8]}"
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(partial),
        num_extract_workers=workers,
        num_merge_workers=max(1, workers // 2),
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    # DeepSpeed's converter unpickles every file in full (weights_only=False): each is vetted by the
    # weights-only loader first, so a file rewritten in the store runs nothing here either (safe_load.py).
    for path in sorted(Path(source).glob("*.pt")):
        safe_load.vet(path)
    chatter = io.StringIO()  # the converter prints progress bars and banners; keep them off the log
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal(args)
    except Exception as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(
            f"{source}: DeepSpeed's universal conversion failed ({type(err).__name__}: {err})"
        ) from None
    (root / "latest_universal").unlink(missing_ok=True)  # the converter writes it; tags are always explicit
    write_durably(partial / CONVERTED, json.dumps({"step": step, "manifest_sha256": source_sha256}).encode())
    target = root / mf.step_dir_name(step)
    os.replace(partial, target)
    return target


def gather(
    step_dir: Path, world_size: int, num_nodes: int, fetch_node: Optional[Callable[[int, Path], Path]], staging: Path
) -> Path:
    """A directory holding every source rank's files of the step: `step_dir` itself when it has them
    all (one node wrote it), else `staging` with links to the local files and the other nodes'
    parts fetched from the store by `fetch_node(node_rank, directory)`."""
    have = ranks_present(step_dir)
    if have >= set(range(world_size)):
        return step_dir
    if fetch_node is None:
        missing = sorted(set(range(world_size)) - have)
        raise CheckpointError(
            f"{step_dir} was written by {num_nodes} nodes and holds ranks {sorted(have)} only; resuming at another "
            f"world size needs every rank's part (missing {missing}): set storage.store so the other nodes' parts "
            "can be fetched, or resume with the same nodes"
        )
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, mode=0o700)
    for name in os.listdir(step_dir):
        if name.endswith(".pt"):
            os.symlink(Path(step_dir).resolve() / name, staging / name)
    per_node = max(1, world_size // max(1, num_nodes))
    for node in range(num_nodes):
        if set(range(node * per_node, (node + 1) * per_node)) <= have:
            continue  # this node's part is here already
        part = fetch_node(node, staging.parent / f"{staging.name}.node-{node}")
        try:
            for name in os.listdir(part):
                if name.endswith(".pt") and not (staging / name).exists():
                    os.replace(part / name, staging / name)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    have = ranks_present(staging)
    if have < set(range(world_size)):
        raise CheckpointError(f"{step_dir}: the store's copy lacks ranks {sorted(set(range(world_size)) - have)}")
    return staging
