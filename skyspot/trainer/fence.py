"""Fencing: of two attempts of one run alive at once, only the newer one commits to the store.

SkyPilot's controller judges a cluster gone from status checks, and its users report healthy jobs
relaunched on status-fetch timeouts (skypilot-org/skypilot #10123, #10155, #10664); a relaunch can
start while the old cluster still trains, and deadline mode's stage switch overlaps two attempts on
purpose. Both then write `<store>/<run>/`. Object stores have no multi-object transactions, so one
object is the point every commit passes through, written only by compare-and-swap (`Store.put_if`:
S3 If-Match / If-None-Match, GCS generation preconditions, Azure ETag conditions, a lock on the local
store):

    <run>/fence.json   {"epoch": E, "taken_at": ts, "by": "host pid",
                        "commits": {"<step>": {"<node>/<nodes>": epoch that committed it}}}

- An attempt takes the next epoch when it starts (`take`), before it lists what to resume from:
  epochs only grow, so every attempt started later holds a larger one. (`epoch`, not "generation":
  restart.py's generations are a restart in place's workers, which keep their attempt's epoch.)
- A node's checkpoint part counts only when the fence records it (`commit`, after the node's marker
  is in the store): the swap is refused when the fence holds a newer epoch, so a stale attempt's
  marker may lie in the store but never counts (`visible` drops it from every listing a reader uses).
- Retention takes a step out of the fence (`forget`) before its files go, under the same check.
- Every other write of an attempt (event segments, `final/`, the files of a checkpoint before its
  commit) is checked against the fence first (`check`): a check, not a condition, since S3's
  conditions are per object; those keys are the attempt's own (per attempt or per step, never the
  fence's), and none of them makes a checkpoint count.

An attempt that learns it is stale raises `Stale`; the trainer stops and exits STALE (exit_codes.py),
which is no failure of the run, and leaves one create-only record `stale/epoch-<E>.node-<K>.json` for
the status and the cost report (skyspot.events reads them as `stale_attempt` events).

A store written before fencing has no fence.json: the first `take` records the durable checkpoints
already there as commits of epoch 0, and until then readers trust the markers alone, as before.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from typing import Callable, Iterable, Optional

from skyspot.errors import StoreError
from skyspot.events import STALE_DIR
from skyspot.storage import Store, join_key, with_retries
from skyspot.storage.store import PreconditionFailed
from skyspot.trainer import manifest as mf

FENCE = "fence.json"
MAX_SWAPS = 50
"""Swaps lost in a row to the attempt's own nodes (each node commits its part) before giving up."""
_RETRY = dict(attempts=5, base_delay=0.5, max_delay=10.0)
Doc = dict


class Stale(Exception):
    """This attempt's epoch is older than the fence's: a newer attempt of the run has started."""

    def __init__(self, epoch: int, newer: int, what: str):
        self.epoch, self.newer, self.what = epoch, newer, what
        super().__init__(f"{what} refused: attempt epoch {epoch} is stale, the run's store is held by epoch {newer}")


def node_key(node: int, nodes: int) -> str:
    return f"{node}/{nodes}"


def stale_record_key(run_prefix: str, epoch: int, node: int) -> str:
    """One event line (skyspot.events reads `<run>/stale/*.jsonl` beside `events/`)."""
    return join_key(run_prefix, STALE_DIR, f"epoch-{epoch}.node-{node}.jsonl")


def _parse(raw: Optional[bytes], where: str) -> Optional[Doc]:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not (
        isinstance(doc, dict)
        and isinstance(doc.get("epoch"), int)
        and not isinstance(doc["epoch"], bool)
        and isinstance(doc.get("commits"), dict)
        and all(isinstance(v, dict) for v in doc["commits"].values())
    ):
        raise StoreError(f"{where} is not a fence record; remove it only if no attempt of the run is alive")
    return doc


def read(store: Store, run_prefix: str, *, retry: bool = True) -> Optional[Doc]:
    """The fence as it is now; None for a store written before fencing. `retry=False`: one request (a
    caller on the training thread, which must not wait out an outage's backoff)."""
    key = join_key(run_prefix, FENCE)
    raw, _version = with_retries(lambda: store.get_versioned(key), **_RETRY) if retry else store.get_versioned(key)
    return _parse(raw, f"{store.uri}/{key}")


def visible(doc: Optional[Doc], keys_by_step: dict[int, set[str]]) -> dict[int, set[str]]:
    """A listing by step with every node marker the fence does not record taken out (a stale attempt's,
    or one whose swap has not landed yet); unchanged without a fence. Pure."""
    if doc is None:
        return keys_by_step
    commits = doc["commits"]
    shown: dict[int, set[str]] = {}
    for step, keys in keys_by_step.items():
        recorded = commits.get(str(step), {})
        kept = set()
        for key in keys:
            match = mf.NODE_MARKER.match(key.rsplit("/", 1)[-1])
            if match is None or node_key(int(match.group(1)), int(match.group(2))) in recorded:
                kept.add(key)
        shown[step] = kept
    return shown


class Fence:
    """One attempt's hold on its run's store (one per node leader; global rank 0's `take` fixes the epoch)."""

    def __init__(self, store: Store, run_prefix: str, epoch: Optional[int] = None):
        self.store = store
        self.run_prefix = run_prefix
        self.key = join_key(run_prefix, FENCE)
        self.where = f"{store.uri}/{self.key}"
        self.epoch = epoch
        """None until known: an attempt that could not reach the store at its start joins the fence's epoch at
        its first commit."""
        self.stale: Optional[Stale] = None

    # ------------------------------------------------------------------ swaps
    def _swap(self, change: Callable[[Optional[Doc]], Doc]) -> Doc:
        """Read, change, write back only if nobody wrote in between; again when somebody did."""
        for _ in range(MAX_SWAPS):
            raw, version = with_retries(lambda: self.store.get_versioned(self.key), **_RETRY)
            new = change(_parse(raw, self.where))
            body = (json.dumps(new, sort_keys=True) + "\n").encode()
            try:
                with_retries(lambda: self.store.put_if(self.key, body, version), **_RETRY)
                return new
            except PreconditionFailed:
                time.sleep(random.uniform(0.01, 0.1))  # another node's swap landed first: read it again
        raise StoreError(f"{self.where}: {MAX_SWAPS} swaps in a row lost to other writers")

    def _held(self, doc: Optional[Doc], what: str) -> None:
        """Raise Stale (and remember it) when `doc` holds a newer epoch than ours."""
        if self.stale is not None:
            raise self.stale
        if doc is not None and self.epoch is not None and doc["epoch"] > self.epoch:
            self.stale = Stale(self.epoch, doc["epoch"], what)
            raise self.stale

    def take(self, legacy_durable: Callable[[], dict[int, set[str]]]) -> int:
        """A new attempt: the next epoch, strictly above any attempt's before. `legacy_durable` lists the
        checkpoints (by step) whose markers count on a store written before fencing."""

        def change(doc: Optional[Doc]) -> Doc:
            if doc is None:
                commits: dict[str, dict[str, int]] = {}
                for step, keys in legacy_durable().items():
                    for key in keys:
                        match = mf.NODE_MARKER.match(key.rsplit("/", 1)[-1])
                        if match:
                            commits.setdefault(str(step), {})[node_key(int(match.group(1)), int(match.group(2)))] = 0
                doc = {"epoch": 0, "commits": commits}
            return {**doc, "epoch": doc["epoch"] + 1, "taken_at": time.time(), "by": _holder()}

        self.epoch = self._swap(change)["epoch"]
        return self.epoch

    def commit(self, step: int, node: int, nodes: int) -> None:
        """Record node `node`'s part of `step` (its marker is in the store): from now on it counts."""

        def change(doc: Optional[Doc]) -> Doc:
            self._held(doc, f"the commit of step {step}")
            doc = doc or {"epoch": 0, "commits": {}}
            # Not taken at the start (the store was unreachable then): join the fence's epoch, since this
            # attempt's other nodes join it too (a node taking its own would fence off its peers); fencing
            # against an older attempt holds again from the next start, which takes one.
            mine = self.epoch if self.epoch is not None else doc["epoch"]
            steps = {k: dict(v) for k, v in doc["commits"].items()}
            steps.setdefault(str(step), {})[node_key(node, nodes)] = mine
            return {**doc, "epoch": max(doc["epoch"], mine), "commits": steps}

        doc = self._swap(change)
        if self.epoch is None:
            self.epoch = doc["epoch"]

    def forget(self, steps: Iterable[int]) -> None:
        """Take `steps` out of the fence before retention deletes their files."""
        names = {str(s) for s in steps}

        def change(doc: Optional[Doc]) -> Doc:
            self._held(doc, "retention")
            doc = doc or {"epoch": 0, "commits": {}}
            return {**doc, "commits": {k: v for k, v in doc["commits"].items() if k not in names}}

        if names:
            self._swap(change)

    def check(self, what: str) -> None:
        """One read: Stale when a newer attempt holds the store (before a write the fence does not guard)."""
        if self.stale is not None:
            raise self.stale
        self._held(read(self.store, self.run_prefix), what)

    def leave_record(self, node: int, event: dict) -> None:
        """The stale attempt's one record (its `stale_attempt` event), create-only: never over another's.
        Best effort."""
        if self.stale is None:
            return
        key = stale_record_key(self.run_prefix, self.stale.epoch, node)
        try:
            self.store.put_if(key, (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode(), None)
        except (StoreError, OSError):
            pass  # already there (a restart in place of the same stale attempt), or the store is away


def _holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


EPOCH_FILE = "epoch.json"
"""DIR/epoch.json: the epoch this node's attempt holds, for the workers of its restarts in place."""


def remember(run_dir, epoch: int) -> None:
    from skyspot.trainer.files import atomic_write_json

    atomic_write_json(os.path.join(run_dir, EPOCH_FILE), {"epoch": epoch})


def remembered(run_dir) -> Optional[int]:
    try:
        with open(os.path.join(run_dir, EPOCH_FILE), encoding="utf-8") as handle:
            epoch = json.load(handle).get("epoch")
    except (OSError, ValueError, AttributeError):
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
