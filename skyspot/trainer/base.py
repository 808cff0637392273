"""The base model's files on each node: config, tokenizer and (where needed) the pretrained weights.

    base = BaseModel(recipe, run_dir, placement, comm, tier=tier, emit=run.emit, say=say)
    base.prepare(weights=False)     # collective: config and tokenizer files on every node
    ...                             # tokenizer, data (a bad data set fails here, before any weights move)
    base.prepare(weights=True)      # collective: the weights where the loader reads them (global rank 0
                                    # under ZeRO-3, every rank otherwise); only for a fresh start or LoRA
    base.start_copy()               # global rank 0: keep a copy in the run's store (first start from the hub)
    base.path                       # this node's directory (config.json, tokenizer files, *.safetensors)

Where the files come from, first that applies (the `base_model` event's `source`):

    local        model.hub_id is a local directory: read in place
    cache        this node already fetched them for this run (DIR/base.json names the directory and
                 the hub commit): a restart on the same disk needs nothing
    store mount  the run's copy in its store, `<store>/<run id>/base/` (complete once BASE.json is
                 there), read in place through the task's bucket mount (SKYSPOT_STORE_MOUNT), in the
                 bucket's region: config and tokenizer only; a local store is its own mount
    store        that copy, downloaded into DIR/base/ in parallel (the weights always: never mmapped
                 through a FUSE mount; everything when the node has no mount)
    hub          the Hugging Face hub at model.revision (then pinned to the commit it resolved), into
                 the Hugging Face cache; asked first whether it can be reached and read (hub.py), so an
                 unreachable or gated hub is one line and exit 2, not minutes of retries

The first start that downloads the weights from the hub copies them into the run's store in the
background (global rank 0; BASE.json written last), so every later start, on any node, reads the
store instead of the hub. A full fine-tune that resumes never needs the weights at all: the model
is built from its config under zero.Init and the checkpoint fills it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from skyspot.errors import StoreError, UsageError

BASE_DIR = "base"  # DIR/base/ (a download of the store's copy) and <store>/<run id>/base/
BASE_RECORD = "base.json"  # DIR/base.json: this node's directory for the run, and the hub commit
COMPLETE = "BASE.json"  # written last into the store's copy: repo, commit, files and sizes
MOUNT_ENV = "SKYSPOT_STORE_MOUNT"  # the store's root on the node, where the task mounts it
WEIGHT_SUFFIX = ".safetensors"


def _is_weight(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIX)


def _files(directory: Path) -> dict[str, int]:
    """Relative path -> size of the files under `directory` (following the hub cache's symlinks)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_file() and not rel.startswith(".") and "/." not in rel:
            out[rel] = path.stat().st_size
    return out


def has_files(directory: Optional[Path], weights: bool) -> bool:
    if directory is None or not (directory / "config.json").is_file():
        return False
    return not weights or any(directory.glob(f"*{WEIGHT_SUFFIX}"))


class BaseModel:
    def __init__(
        self,
        recipe,
        run_dir: Path,
        placement,
        comm,
        *,
        tier=None,
        emit: Callable[..., None] = lambda *a, **k: None,
        say: Callable[[str], None] = print,
        environ=os.environ,
    ):
        self.recipe = recipe
        self.section = recipe.model
        self.run_dir = Path(run_dir)
        self.placement = placement
        self.comm = comm
        self.tier = tier
        self.emit = emit
        self.say = say
        self.environ = environ
        self.path: Optional[Path] = None
        self.source: Optional[str] = None
        self.commit: Optional[str] = None
        self.weights = False
        self.copy_thread: Optional[threading.Thread] = None

    @property
    def needed(self) -> bool:
        return self.section.hub_id is not None

    def weights_here(self) -> bool:
        """Does this rank read the weights? Under ZeRO-3 only global rank 0 does (model.load_weights)."""
        return self.recipe.deepspeed.zero_stage < 3 or self.placement.rank == 0

    # ------------------------------------------------------------------ collective
    def prepare(self, *, weights: bool) -> None:
        """Every rank: make this node's files ready (weights only where they are read)."""
        if not self.needed:
            return
        start = time.monotonic()
        want = weights and (self.recipe.deepspeed.zero_stage < 3 or self.placement.node_rank == 0)
        mine: Any = None
        if self.placement.is_node_leader:
            try:
                path, source, commit = self._locate(want)
                mine = (self.placement.node_rank, str(path), source, commit, None)
            except (UsageError, StoreError, OSError) as err:
                mine = (self.placement.node_rank, None, None, None, f"{type(err).__name__}|{err}")
            except Exception as err:  # noqa: BLE001 - never leave the other ranks waiting
                mine = (self.placement.node_rank, None, None, None, f"Exception|{type(err).__name__}: {err}")
        views = [v for v in self.comm.io_gather(mine) if v is not None]  # while leaders download (comm.py)
        errors = [v[4] for v in views if v[4]]
        if errors:
            kind, _, message = errors[0].partition("|")
            raise UsageError(message) if kind == "UsageError" else RuntimeError(message)
        node_rank, path, source, commit, _ = next(v for v in views if v[0] == self.placement.node_rank)
        self.path, self.source, self.commit = Path(path), source, commit
        self.weights = self.weights or weights
        if self.placement.is_global_zero:
            files = _files(self.path) if source != "local" else {}
            self.emit(
                "base_model",
                repo=self.section.hub_id,
                revision=self.section.revision,
                commit=commit,
                source=source,
                path=path,
                weights=weights,
                seconds=round(time.monotonic() - start, 6),
                bytes=sum(files.values()) if files else None,
            )

    # ------------------------------------------------------------------ node leader
    def _locate(self, weights: bool) -> tuple[Path, str, Optional[str]]:
        from skyspot import hub

        ref = self.section.hub_id
        if self.section.is_local:
            hub.check_local_model(ref, need_weights=True)
            return Path(ref), "local", None
        # The weights are never read through the bucket mount: a FUSE mount pages a 141 GB mmap in on
        # demand, one fault at a time, on global rank 0 alone while every other rank waits (LoRA's frozen
        # base, a fresh start). They are downloaded into DIR/base/ first, in parallel, with the SDK.
        if self.path is not None and has_files(self.path, weights) and not (weights and self._mounted(self.path)):
            return self.path, self.source, self.commit  # the files of the first call have them
        pinned = self._pinned()
        if (
            pinned is not None
            and has_files(Path(pinned["path"]), weights)
            and not (weights and self._mounted(Path(pinned["path"])))
        ):
            return Path(pinned["path"]), "cache", pinned.get("commit")
        copy = self._store_copy()
        if copy is not None:
            mounted = self._mounted_copy(copy)
            if mounted is not None and weights and self._mounted(mounted):
                mounted = None  # the weights come down below (a local store's copy is read in place)
            if mounted is not None:
                self._pin(mounted, copy.get("commit"))
                return mounted, "store mount", copy.get("commit")
            target = self.run_dir / BASE_DIR
            self._download_copy(copy, target, weights)
            self._pin(target, copy.get("commit"))
            return target, "store", copy.get("commit")
        path, commit = self._from_hub(weights, pinned.get("commit") if pinned else None)
        self._pin(path, commit)
        return path, "hub", commit

    def _pinned(self) -> Optional[dict]:
        try:
            record = json.loads((self.run_dir / BASE_RECORD).read_text())
        except (OSError, ValueError):
            return None
        same = record.get("repo") == self.section.hub_id and record.get("revision") == self.section.revision
        return record if isinstance(record, dict) and same and record.get("path") else None

    def _pin(self, path: Path, commit: Optional[str]) -> None:
        from skyspot.trainer.files import atomic_write_json

        atomic_write_json(
            self.run_dir / BASE_RECORD,
            {"repo": self.section.hub_id, "revision": self.section.revision, "commit": commit, "path": str(path)},
        )

    def _store_copy(self) -> Optional[dict]:
        """The store's BASE.json for this repo and revision, when the copy is complete."""
        if self.tier is None:
            return None
        from skyspot.storage import join_key, with_retries

        try:
            raw = with_retries(
                lambda: self.tier.store.get_bytes(join_key(self.tier.run_id, BASE_DIR, COMPLETE)),
                attempts=3,
                base_delay=0.5,
                max_delay=2.0,
            )
            record = json.loads(raw) if raw else None
        except (StoreError, ValueError) as err:
            self.say(f"the store's copy of the base model is unreadable ({err}); using the hub")
            return None
        if (
            not isinstance(record, dict)
            or record.get("repo") != self.section.hub_id
            or record.get("revision") != self.section.revision
            or not isinstance(record.get("files"), dict)
        ):
            return None
        return record

    def _mount_root(self) -> Optional[Path]:
        from skyspot.storage import parse_store_uri

        mount = self.environ.get(MOUNT_ENV, "").strip()
        if mount:
            return Path(mount)
        uri = parse_store_uri(self.tier.uri)
        return Path(uri.prefix) if uri.is_local else None

    def _mounted(self, path: Path) -> bool:
        """Whether `path` is read through the task's bucket mount (SKYSPOT_STORE_MOUNT), not a local disk."""
        mount = self.environ.get(MOUNT_ENV, "").strip()
        return bool(mount) and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(mount))

    def _mounted_copy(self, copy: dict) -> Optional[Path]:
        """The copy read in place through the bucket mount, when every file is there at its size."""
        root = self._mount_root()
        if root is None:
            return None
        directory = root / self.tier.run_id / BASE_DIR
        try:
            ok = all((directory / name).stat().st_size == size for name, size in copy["files"].items())
        except OSError:
            return None
        return directory if ok and (directory / "config.json").is_file() else None

    def _download_copy(self, copy: dict, target: Path, weights: bool) -> None:
        from skyspot.storage import join_key, with_retries

        wanted = [n for n in copy["files"] if weights or not _is_weight(n)]
        missing = [
            n for n in wanted if not ((target / n).is_file() and (target / n).stat().st_size == copy["files"][n])
        ]
        if missing:
            target.mkdir(parents=True, exist_ok=True)
            with_retries(
                lambda: self.tier.store.download_files(join_key(self.tier.run_id, BASE_DIR), missing, target),
                attempts=5,
                base_delay=1.0,
                max_delay=30.0,
            )

    def _from_hub(self, weights: bool, commit: Optional[str]) -> tuple[Path, Optional[str]]:
        from skyspot import hub

        repo = self.section.hub_id
        revision = commit or self.section.revision
        hub.check_model(repo, revision=revision, gated=self.section.gated, environ=self.environ, need_weights=weights)
        from huggingface_hub import snapshot_download

        try:
            path = Path(
                snapshot_download(
                    repo,
                    revision=revision,
                    allow_patterns=hub.MODEL_FILES if weights else hub.LIGHT_FILES,
                    ignore_patterns=hub.IGNORED_FILES,
                    token=hub.token(self.environ) or None,
                    local_files_only=hub.offline(self.environ),
                    cache_dir=str(hub.cache_dir(self.environ)),
                    endpoint=hub.endpoint(self.environ),
                )
            )
        except Exception as err:  # noqa: BLE001
            if hub.is_network_error(err):
                raise hub.unreachable(f"model.hub_id {repo}", self.environ, err) from None
            raise
        if not has_files(path, weights):
            raise UsageError(
                f"model.hub_id {repo}: the download has no config.json"
                + (" or no *.safetensors weights" if weights else "")
            )
        return path, path.name  # the cache's snapshots/<commit>/

    # ------------------------------------------------------------------ the store's copy
    def start_copy(self) -> None:
        """Global rank 0, after the weights came from the hub: copy them into the run's store in the
        background (BASE.json last), unless the store has a complete copy already."""
        # Whether the store has a copy already is asked in the thread: global rank 0 goes on to the next
        # collective at once, whatever the store's latency.
        if (
            self.tier is None
            or not self.placement.is_global_zero
            or self.source not in ("hub", "cache")
            or not self.weights
            or self.path is None
        ):
            return
        self.copy_thread = threading.Thread(target=self._copy, name="skyspot-base-copy", daemon=True)
        self.copy_thread.start()

    def _copy(self) -> None:
        from skyspot.storage import join_key, with_retries

        if self._store_copy() is not None:
            return
        start = time.monotonic()
        files = _files(self.path)
        prefix = join_key(self.tier.run_id, BASE_DIR)
        store = self.tier.store
        error = None
        try:
            present = set(with_retries(lambda: store.list(prefix + "/"), attempts=3))
            todo = [n for n in files if join_key(prefix, n) not in present]
            with_retries(lambda: store.upload_dir(self.path, prefix, todo), attempts=5, base_delay=2.0, max_delay=60.0)
            record = {
                "repo": self.section.hub_id,
                "revision": self.section.revision,
                "commit": self.commit,
                "files": files,
                "created_at": time.time(),
            }
            with_retries(
                lambda: store.put_bytes(join_key(prefix, COMPLETE), (json.dumps(record, indent=1) + "\n").encode()),
                attempts=5,
            )
        except (StoreError, OSError) as err:
            error = str(err)
            self.say(f"could not copy the base model into the store ({err}); later starts download it again")
        self.emit(
            "base_copy",
            files=len(files),
            bytes=sum(files.values()),
            seconds=round(time.monotonic() - start, 6),
            error=error,
        )
