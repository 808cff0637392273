"""What makes a directory a checkpoint: a manifest, a commit marker written last, and matching files.

    checkpoints/step_<N>/
        <DeepSpeed's files>              zero_pp_rank_<R>_mp_rank_00_{model,optim}_states.pt
        trainer_state_rank_<R>.pt        per rank: RNG states, data position (ours)
        manifest.json                    step, data position, world size, recipe, per-file size + sha256
        COMMITTED                        {"step": N, "manifest_sha256": ...}, written last

A directory is a checkpoint only when its marker names its step and the manifest's hash, and
every file the manifest lists has the listed size and sha256. Anything else is not a checkpoint:

    incomplete   no marker: the write never finished (a kill mid-write leaves this; harmless)
    corrupt      a marker is present but the manifest or a file disagrees with it

The manifest lists the files written on this node (each node's directory is its own fast tier);
the ranks agree on a step that is valid on every node before resuming (see checkpoint.py).

In the store (remote.py) a step's directory holds every node's files side by side, so each node's
manifest and marker carry its number there, and the marker's name says how many nodes wrote it:

    checkpoints/step_<N>/manifest.node-<K>.json        node K's manifest.json
    checkpoints/step_<N>/COMMITTED.node-<K>-of-<M>     node K's COMMITTED, its last upload

This module is the one definition of these names, the step pattern and the hash; everything
else imports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from skyspot.trainer.files import fsync_dir, write_durably

FORMAT = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
LATEST = "latest"
"""Advisory: the newest committed step's directory name (DeepSpeed's convention); never read on resume."""
STEP_DIR = re.compile(r"^step_(\d+)$")
NODE_MARKER = re.compile(r"^COMMITTED\.node-(\d+)-of-(\d+)$")
HASH_CHUNK = 8 * 1024 * 1024

State = Literal["valid", "incomplete", "corrupt"]


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def node_manifest_name(node_rank: int) -> str:
    """Node K's manifest in the store (locally it is `manifest.json`)."""
    return f"manifest.node-{node_rank}.json"


def node_marker_name(node_rank: int, num_nodes: int) -> str:
    """Node K's commit marker in the store (locally `COMMITTED`); the name says how many nodes there are."""
    return f"COMMITTED.node-{node_rank}-of-{num_nodes}"


def is_marker(name: str) -> bool:
    """A commit marker's file name, local or a node's in the store."""
    return name.startswith(MARKER)


def _reserved(name: str) -> bool:
    return name in (MANIFEST, MARKER) or name.startswith(("manifest.node-", "COMMITTED."))


def safe_relpath(rel: str) -> bool:
    """A manifest entry that stays inside its checkpoint and is not a manifest or marker name."""
    parts = rel.split("/")
    return not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts) and not _reserved(rel)


def file_table(manifest: object) -> dict[str, dict]:
    """A manifest's file table, checked: safe paths, each with an integer size and a sha256 (ValueError)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError("no 'files' table")
    for rel, meta in files.items():
        if not safe_relpath(rel):
            raise ValueError(f"unsafe path {rel!r}")
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int) and isinstance(meta.get("sha256"), str)):
            raise ValueError(f"entry {rel!r} lacks an integer size and a sha256")
    return files


def new_digest():
    """The checkpoint hash (sha256), to feed incrementally (the writer hashes bytes as they are written)."""
    return hashlib.sha256()


def sha256_bytes(data: bytes) -> str:
    digest = new_digest()
    digest.update(data)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    digest = new_digest()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> str:
    """Write and fsync manifest.json; returns its sha256 (the marker names it)."""
    data = (json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n").encode()
    write_durably(directory / MANIFEST, data)
    return sha256_bytes(data)


def write_marker(directory: Path, step: int, manifest_sha256: str) -> None:
    """The commit point: written only after every file and the manifest are on disk."""
    write_durably(
        directory / MARKER,
        json.dumps({"format": FORMAT, "step": step, "manifest_sha256": manifest_sha256}).encode() + b"\n",
    )
    fsync_dir(directory)


def remove_checkpoint_dir(path: Path) -> None:
    """Unlink the marker first, so a kill mid-delete leaves an 'incomplete' directory, never a 'corrupt' one."""
    try:
        (path / MARKER).unlink()
        fsync_dir(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Verdict:
    step: int
    path: Path
    state: State
    reason: str = ""
    manifest: Optional[dict[str, Any]] = None
    verified: bool = True
    """False when the checksums were not read (only sizes): verify before resuming from it."""

    def __str__(self) -> str:
        return f"{self.path.name}: {self.state}" + (f" ({self.reason})" if self.reason else "")


def inspect(directory: str | os.PathLike, *, verify_checksums: bool = True) -> Verdict:
    """Decide whether `directory` (a step_<N> directory) is a checkpoint."""
    path = Path(directory)
    match = STEP_DIR.match(path.name)
    step = int(match.group(1)) if match else -1

    def bad(state: State, reason: str, manifest=None) -> Verdict:
        return Verdict(step, path, state, reason, manifest)

    try:
        marker_bytes = (path / MARKER).read_bytes()
    except FileNotFoundError:
        return bad("incomplete", "no COMMITTED marker: the write never finished")
    except OSError as err:
        return bad("corrupt", f"marker unreadable: {err}")
    try:
        marker = json.loads(marker_bytes)
        if not isinstance(marker, dict):
            raise ValueError("not an object")
    except ValueError as err:
        return bad("corrupt", f"marker is not valid JSON ({err})")
    if marker.get("step") != step:
        return bad("corrupt", f"marker names step {marker.get('step')!r}, directory is step {step}")
    try:
        manifest_bytes = (path / MANIFEST).read_bytes()
    except OSError:
        return bad("corrupt", "marker present but manifest.json missing")
    if sha256_bytes(manifest_bytes) != marker.get("manifest_sha256"):
        return bad("corrupt", "manifest.json does not match the marker's hash")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as err:
        return bad("corrupt", f"manifest.json is not valid JSON ({err})")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("step") != step or not isinstance(files, dict) or not files:
        return bad("corrupt", "manifest has the wrong step or no files", manifest)
    for rel, meta in sorted(files.items()):
        if not safe_relpath(rel) or not isinstance(meta, dict):
            return bad("corrupt", f"manifest lists an unsafe entry {rel!r}", manifest)
        try:
            size = (path / rel).stat().st_size
        except OSError:
            return bad("corrupt", f"{rel} is missing", manifest)
        if size != meta.get("size"):
            return bad("corrupt", f"{rel} is {size} bytes, the manifest says {meta.get('size')}", manifest)
        if verify_checksums and sha256_file(path / rel) != meta.get("sha256"):
            return bad("corrupt", f"{rel}: sha256 does not match the manifest", manifest)
    return Verdict(step, path, "valid", "", manifest, verified=verify_checksums)


def scan(
    checkpoints_dir: str | os.PathLike, *, verify_checksums: bool = True, stop_at_first_valid: bool = False
) -> list[Verdict]:
    """Every step_<N> directory, newest first, with its verdict.

    With stop_at_first_valid, checksums are read only down to the newest valid directory; older
    ones are checked for marker, manifest and sizes only (`verified` False).
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    dirs = sorted(
        (p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
        key=lambda p: int(STEP_DIR.match(p.name).group(1)),
        reverse=True,
    )
    verdicts: list[Verdict] = []
    found_valid = False
    for d in dirs:
        if found_valid and stop_at_first_valid:
            verdicts.append(inspect(d, verify_checksums=False))
            continue
        verdict = inspect(d, verify_checksums=verify_checksums)
        verdicts.append(verdict)
        found_valid = found_valid or verdict.state == "valid"
    return verdicts
