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
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from skyspot.errors import CheckpointError
from skyspot.storage import Store, join_key, with_retries
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



def listing(store: Store, run_prefix: str) -> dict[int, set[str]]:
    """Every key under the run's checkpoints/, by step."""
    root = join_key(run_prefix, CHECKPOINTS) + "/"
    steps: dict[int, set[str]] = {}
    for key in store.list(root):
        match = mf.STEP_DIR.match(key[len(root):].split("/", 1)[0])
        if match:
            steps.setdefault(int(match.group(1)), set()).add(key)
    return steps


def durable_steps(keys_by_step: dict[int, set[str]]) -> list[int]:
    """The steps of a listing whose markers of every node are there, oldest first. Pure."""
    return sorted(step for step, keys in keys_by_step.items() if is_durable_listing(keys))


def remote_checkpoints(store: Store, run_prefix: str) -> list[int]:
    """Durable steps (every node's marker exists), oldest first. Their files are verified on download."""
    return durable_steps(listing(store, run_prefix))


def download_checkpoint(store: Store, run_prefix: str, step: int, local_dir: str | os.PathLike,
                        max_workers: int = 8, *, node_rank: int = 0, any_node: bool = False) -> Path:
    """Download node `node_rank`'s part of a durable checkpoint to `local_dir`, verifying every file.

    Only the files the node's manifest lists come down (each node's directory holds only
    what its ranks wrote), as `manifest.json` and `COMMITTED` locally. Files land in a
    hidden sibling directory that is renamed into place once all of them check out, so a
    half download never looks like a checkpoint. Raises `CheckpointError` naming the file
    when one is missing or corrupt (the caller falls back to an earlier checkpoint);
    `StoreError` when the store stays unreachable.
    """
    target = Path(local_dir)
    prefix = checkpoint_prefix(run_prefix, step)
    where = f"checkpoint step_{step} in {store.uri}"

    def get(fn):
        return with_retries(fn, attempts=4, base_delay=0.5, max_delay=5.0)

    keys = get(lambda: store.list(prefix + "/"))
    if not is_durable_listing(keys):
        have = sorted(f"node {k} of {n}" for k, n in _markers(keys))
        raise CheckpointError(f"{where} is not durable: it lacks a {mf.MARKER} marker of every node"
                              + (f" (has {', '.join(have)})" if have else ""))
    nodes = max(n for _, n in _markers(keys) if all((k, n) in _markers(keys) for k in range(n)))
    if node_rank >= nodes and any_node:
        node_rank = 0  # a node the writer did not have: node 0's part names the step (reshard.py gathers the rest)
    if node_rank >= nodes:
        raise CheckpointError(f"{where} was written by {nodes} nodes; this is node {node_rank}")
    marker = get(lambda: store.get_bytes(join_key(prefix, mf.node_marker_name(node_rank, nodes))))
    if marker is None:
        raise CheckpointError(f"{where}: the marker of node {node_rank} is missing")
    raw = get(lambda: store.get_bytes(join_key(prefix, mf.node_manifest_name(node_rank))))
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

    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.download-{uuid.uuid4().hex[:8]}")
    temp.mkdir()
    try:
        def missing() -> list[str]:
            return [rel for rel, meta in files.items()
                    if not (temp / rel).is_file() or (temp / rel).stat().st_size != meta["size"]]

        try:
            # A retry after a transient error fetches only what is not there yet.
            get(lambda: store.download_files(prefix, missing(), temp, max_workers))
        except FileNotFoundError as error:
            rel = str(error.filename).removeprefix(f"{store.uri}/{prefix}/")
            raise CheckpointError(f"{where}: file {rel!r} is missing from the store") from None

        def verify(rel: str) -> None:
            meta = files[rel]
            size = (temp / rel).stat().st_size
            if size != meta["size"]:
                raise CheckpointError(
                    f"{where}: file {rel!r} is corrupt ({size} bytes, the manifest says {meta['size']})")
            if mf.sha256_file(temp / rel) != meta["sha256"].lower():
                raise CheckpointError(f"{where}: file {rel!r} is corrupt (sha256 does not match the manifest)")

        # hashlib releases the GIL on large buffers, so hashing in threads uses several cores.
        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            for _ in pool.map(verify, sorted(files)):
                pass
        (temp / mf.MANIFEST).write_bytes(raw)
        (temp / mf.MARKER).write_bytes(marker)  # last, as when the checkpoint was written
        if target.exists():
            stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return target
