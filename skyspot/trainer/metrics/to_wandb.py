"""Weights & Biases: the run name is the W&B run id, every attempt resumes it (`resume="allow"`).

W&B's step is monotonic: a point at a step lower than the run's last is dropped (with a warning of
W&B's own per point), and there is no way to draw it again short of rewinding the run (`resume_from`,
on a server that supports it). So this backend sends nothing at or below the last step the run
holds: online, the resumed run's `starting_step` (W&B's last step + 1); offline (WANDB_MODE=offline),
the run's offline records under DIR/wandb/ (read with wandb's own datastore reader), which are kept
in the store like TensorBoard's files, so that `wandb sync` later finds every attempt's records.
The key (WANDB_API_KEY) reaches the node as a SkyPilot secret and is read by wandb from the
environment; nothing here writes it. Console capture is off (the trainer's output is the node's log).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

DIR = "wandb"


def wandb_id(run_id: str) -> str:
    """A W&B run id from the run's name (W&B refuses `/ \\ # ? % :` in one)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", run_id)[:128]


def offline() -> bool:
    return os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun")


class WandB:
    name = "wandb"
    store_key = DIR

    def __init__(self, run_dir: Path, settings=None):
        self.root = Path(run_dir)  # wandb writes into <root>/wandb/
        self.run = None
        self.last = 0
        self._top = 0
        self._written: dict[str, int] = {}

    def kept_dir(self):
        return self.root / DIR if offline() else None  # online, the server keeps the run

    def open(self, ctx) -> None:
        import wandb

        if not offline():
            _check_reachable(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
        cfg = ctx.settings
        run_id = wandb_id(ctx.run_id)
        (self.root / DIR).mkdir(parents=True, exist_ok=True)
        # A service of our own: WANDB_SERVICE inherited from whatever launched the trainer (a process with
        # a W&B run of its own) would be shared across attempts, and when an attempt is SIGKILLed that
        # service lives on holding this run's id ("run ID ... is in use"), refusing every later attempt.
        os.environ.pop("WANDB_SERVICE", None)
        self.run = wandb.init(
            id=run_id,
            name=ctx.run_id,
            resume="allow",
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            dir=str(self.root),
            config={"skyspot": {"recipe": ctx.recipe.name, "fingerprint": ctx.recipe.fingerprint()}},
            settings=wandb.Settings(
                console="off", silent=True, save_code=False, disable_git=True, disable_job_creation=True
            ),
        )
        self.last = max(0, int(self.run.starting_step or 0) - 1)
        if offline():
            self.last = max(
                [self.last]
                + [int(r["_step"]) for r in read_history(self.root / DIR, run_id) if isinstance(r.get("_step"), int)]
            )

    def describe(self) -> str:
        return f"wandb ({'offline, ' if offline() else ''}run {self.run.id})"

    def has(self, tag: str, step: int) -> bool:
        # Within this start: the same step may still gain tags (its row is open until a later step is
        # logged), an earlier one never.
        return step <= self.last or step < self._top or step <= self._written.get(tag, -1)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)
        self._top = max(self._top, step)
        for tag in scalars:
            self._written[tag] = step

    def where(self, step: int, text: str, where: Mapping[str, Any]) -> None:
        self.run.summary["spot/where"] = text
        tags = {str(where[k])[:64] for k in ("cloud", "region") if where.get(k) not in (None, "", "unknown")}
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | tags))

    def flush(self) -> None:
        pass  # wandb's own process writes and sends in the background

    def close(self, kind: str) -> None:
        if kind == "preempted":
            self.run.mark_preempting()  # W&B shows it as preempted, to be resumed, not as crashed
        self.run.finish(exit_code=0 if kind == "complete" else 1)


def _check_reachable(base_url: str, timeout: float = 10.0) -> None:
    """One request to the W&B server: wandb.init against a server that is down retries for as long as the
    process lives (its own init_timeout does not end it), so a dead address is refused here, in one line."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(base_url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as err:
        raise ConnectionError(f"{base_url} does not answer ({getattr(err, 'reason', err)})") from None


def abandon() -> None:
    """End wandb's service process, so that the trainer can exit: wandb's exit hook waits for it, and it
    waits for its server (for ever, if the server went away). What it had not sent is lost there; the
    next attempt sends it again from the events (sink.py)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if "wandb" in child.name():
                child.kill()
        except psutil.Error:
            pass
    import wandb

    try:
        wandb.teardown(1)  # unregisters the exit hook; its message to the dead process fails, as expected
    except Exception:  # noqa: BLE001
        pass


def read_history(directory: Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row of run `run_id`'s offline records under `directory` (DIR/wandb), oldest record
    file first, with wandb's own datastore reader; a torn tail (a SIGKILL mid-write) ends a file's rows."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    rows: list[dict[str, Any]] = []
    # offline-run-<time>-<id>[-N]/ (wandb adds -N when two starts share a second): the file names the run.
    for path in sorted(Path(directory).glob(f"offline-run-*/run-{run_id}.wandb")):
        store = DataStore()
        try:
            store.open_for_scan(str(path))
            while (data := store.scan_data()) is not None:
                record = wandb_internal_pb2.Record()
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        {
                            item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item
                        }
                    )
        except Exception:  # noqa: BLE001 - a torn (SIGKILL mid-write) or foreign file: its rows so far
            continue
    return rows
