"""Checkpoints in the run's store, read side: which are durable, and downloading one verified.

Remote layout under `<run_prefix>/` (names from manifest.py and rundir.py):

    checkpoints/step_<N>/<files of every node>                 file names are unique per rank
    checkpoints/step_<N>/manifest.node-<K>.json                node K's manifest
    checkpoints/step_<N>/COMMITTED.node-<K>-of-<NODES>         node K's marker, its last upload

A remote checkpoint is *durable* only when the markers of all NODES nodes exist (the marker's
name carries NODES, so one listing decides). The upload worker (uploader.py) writes this layout;
this module only reads it:

    remote_checkpoints(store, run_id)                       # durable steps, oldest first
    download_checkpoint(store, run_id, step, local_dir)     # this node's part, verified, renamed into place
    plan_part, shares, fetch_files, complete_part           # the same, its files split among a node's ranks
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from skyspot.errors import CheckpointError
from skyspot.storage import Store, join_key, with_retries
from skyspot.trainer import fence
from skyspot.trainer import manifest as mf
from skyspot.trainer.rundir import CHECKPOINTS


def checkpoint_prefix(run_prefix: str, step: int) -> str:
    """The key prefix of one checkpoint: `<run_prefix>/checkpoints/step_<N>`."""
    return join_key(run_prefix, CHECKPOINTS, mf.step_dir_name(step))


def _markers(keys) -> set[tuple[int, int]]:
    """(node, nodes) of every node marker among a checkpoint's keys."""
    found = set()
    for key in keys:
        match = mf.NODE_MARKER.match(key.rsplit("/", 1)[-1])
        if match:
            found.add((int(match.group(1)), int(match.group(2))))
    return found


def is_durable_listing(keys) -> bool:
    """Whether a checkpoint's keys include the markers of every node (for some node count). Pure."""
    markers = _markers(keys)
    return any(all((k, n) in markers for k in range(n)) for n in {n for _, n in markers})


def listing(store: Store, run_prefix: str, *, fenced: bool = True) -> dict[int, set[str]]:
    """Every key under the run's checkpoints/, by step, without the node markers the run's fence does
    not record (a stale attempt's: fence.py); `fenced=False`: every marker, as before fencing."""
    root = join_key(run_prefix, CHECKPOINTS) + "/"
    steps: dict[int, set[str]] = {}
    for key in store.list(root):
        match = mf.STEP_DIR.match(key[len(root) :].split("/", 1)[0])
        if match:
            steps.setdefault(int(match.group(1)), set()).add(key)
    # The fence after the listing: a marker listed whose commit has not landed yet is left out, and
    # every commit the fence records had its marker in the store first.
    return fence.visible(fence.read(store, run_prefix), steps) if fenced else steps


def durable_steps(keys_by_step: dict[int, set[str]]) -> list[int]:
    """The steps of a listing whose markers of every node are there, oldest first. Pure."""
    return sorted(step for step, keys in keys_by_step.items() if is_durable_listing(keys))


def remote_checkpoints(store: Store, run_prefix: str) -> list[int]:
    """Durable steps (every node's marker exists), oldest first. Their files are verified on download."""
    return durable_steps(listing(store, run_prefix))


@dataclass
class PartPlan:
    """One node's part of a durable checkpoint, as its marker and manifest in the store describe it."""

    prefix: str
    where: str
    node_rank: int
    files: dict[str, dict]
    marker: bytes
    manifest: bytes


def _get(fn):
    return with_retries(fn, attempts=4, base_delay=0.5, max_delay=5.0)


def plan_part(store: Store, run_prefix: str, step: int, *, node_rank: int = 0, any_node: bool = False) -> PartPlan:
    """Node `node_rank`'s part of durable `step`: its marker, manifest (checked against the marker's hash)
    and file table. `any_node`: a node the writer did not have gets node 0's part (reshard.py gathers
    the rest). CheckpointError when the step is not durable or its node's records are unusable."""
    prefix = checkpoint_prefix(run_prefix, step)
    where = f"checkpoint step_{step} in {store.uri}"
    keys = _get(lambda: store.list(prefix + "/"))
    keys = fence.visible(_get(lambda: fence.read(store, run_prefix)), {step: set(keys)})[step]
    if not is_durable_listing(keys):
        have = sorted(f"node {k} of {n}" for k, n in _markers(keys))
        raise CheckpointError(
            f"{where} is not durable: it lacks a {mf.MARKER} marker of every node"
            + (f" (has {', '.join(have)})" if have else "")
        )
    nodes = max(n for _, n in _markers(keys) if all((k, n) in _markers(keys) for k in range(n)))
    if node_rank >= nodes and any_node:
        node_rank = 0
    if node_rank >= nodes:
        raise CheckpointError(f"{where} was written by {nodes} nodes; this is node {node_rank}")
    marker = _get(lambda: store.get_bytes(join_key(prefix, mf.node_marker_name(node_rank, nodes))))
    if marker is None:
        raise CheckpointError(f"{where}: the marker of node {node_rank} is missing")
    raw = _get(lambda: store.get_bytes(join_key(prefix, mf.node_manifest_name(node_rank))))
    if raw is None:
        raise CheckpointError(f"{where}: {mf.node_manifest_name(node_rank)} is missing")
    try:
        expected = json.loads(marker).get("manifest_sha256")
    except (ValueError, AttributeError):
        raise CheckpointError(f"{where}: the marker of node {node_rank} is not valid JSON") from None
    if expected is not None and mf.sha256_bytes(raw) != expected:
        raise CheckpointError(f"{where}: {mf.node_manifest_name(node_rank)} does not match its marker's hash")
    try:
        files = mf.file_table(json.loads(raw))
    except ValueError as error:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{where}: {mf.node_manifest_name(node_rank)} is unusable ({error})") from None
    return PartPlan(prefix, where, node_rank, files, marker, raw)


def shares(files: dict[str, dict], n: int) -> list[list[str]]:
    """`files` split into `n` shares of about equal bytes (largest first, each to the lightest share),
    the same on every rank: what each local rank downloads. Pure."""
    out: list[list[str]] = [[] for _ in range(max(1, n))]
    load = [0] * len(out)
    for rel in sorted(files, key=lambda r: (-int(files[r]["size"]), r)):
        lightest = load.index(min(load))
        out[lightest].append(rel)
        load[lightest] += int(files[rel]["size"])
    return out


def fetch_files(
    store: Store, plan: PartPlan, names: list[str], directory: str | os.PathLike, max_workers: int = 8
) -> None:
    """Download `names` of the part into `directory` and verify each against the manifest (CheckpointError
    naming the file when one is missing or corrupt; StoreError when the store stays unreachable)."""
    temp = Path(directory)
    files = {rel: plan.files[rel] for rel in names}

    def missing() -> list[str]:
        return [
            rel
            for rel, meta in files.items()
            if not (temp / rel).is_file() or (temp / rel).stat().st_size != meta["size"]
        ]

    try:
        # A retry after a transient error fetches only what is not there yet.
        _get(lambda: store.download_files(plan.prefix, missing(), temp, max_workers))
    except FileNotFoundError as error:
        rel = str(error.filename).removeprefix(f"{store.uri}/{plan.prefix}/")
        raise CheckpointError(f"{plan.where}: file {rel!r} is missing from the store") from None

    def verify(rel: str) -> None:
        meta = files[rel]
        size = (temp / rel).stat().st_size
        if size != meta["size"]:
            raise CheckpointError(
                f"{plan.where}: file {rel!r} is corrupt ({size} bytes, the manifest says {meta['size']})"
            )
        if mf.sha256_file(temp / rel) != meta["sha256"].lower():
            raise CheckpointError(f"{plan.where}: file {rel!r} is corrupt (sha256 does not match the manifest)")

    # hashlib releases the GIL on large buffers, so hashing in threads uses several cores.
    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        for _ in pool.map(verify, sorted(files)):
            pass


def staging_dir(target: str | os.PathLike) -> Path:
    """A hidden sibling of `target` for a download in progress (never mistaken for a checkpoint)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.download-{uuid.uuid4().hex[:8]}")
    temp.mkdir()
    return temp


def complete_part(plan: PartPlan, temp: Path, target: str | os.PathLike) -> Path:
    """The downloaded files in `temp` become the checkpoint `target`: manifest, marker last, renamed into place."""
    target = Path(target)
    (temp / mf.MANIFEST).write_bytes(plan.manifest)
    (temp / mf.MARKER).write_bytes(plan.marker)  # last, as when the checkpoint was written
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(temp, target)
    return target


def download_checkpoint(
    store: Store,
    run_prefix: str,
    step: int,
    local_dir: str | os.PathLike,
    max_workers: int = 8,
    *,
    node_rank: int = 0,
    any_node: bool = False,
) -> Path:
    """Download node `node_rank`'s part of a durable checkpoint to `local_dir`, verifying every file.

    Only the files the node's manifest lists come down (each node's directory holds only
    what its ranks wrote), as `manifest.json` and `COMMITTED` locally. Files land in a
    hidden sibling directory that is renamed into place once all of them check out, so a
    half download never looks like a checkpoint. Raises `CheckpointError` naming the file
    when one is missing or corrupt (the caller falls back to an earlier checkpoint);
    `StoreError` when the store stays unreachable. One process; the trainer's resume splits the
    files among the node's ranks instead (plan_part, shares, fetch_files, complete_part).
    """
    plan = plan_part(store, run_prefix, step, node_rank=node_rank, any_node=any_node)
    temp = staging_dir(local_dir)
    try:
        fetch_files(store, plan, sorted(plan.files), temp, max_workers)
        return complete_part(plan, temp, local_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
