"""MLflow: one MLflow run per skyspot run, its id kept in run.json (`mlflow_run_id`) and resumed.

The tracking URI: the recipe's `metrics.mlflow_tracking_uri`, else MLFLOW_TRACKING_URI, else a file
store in DIR/mlruns, which is kept in the store as `<run>/mlruns/` like TensorBoard's files (MLflow 3
refuses a file store unless MLFLOW_ALLOW_FILE_STORE says it is wanted: for that default it is). The
run is found by run.json's id, else by its `skyspot.run_id` tag (an attempt killed before run.json
reached the store), else created. MLflow keeps every point it is sent, so a point is sent only when
the run's history for that metric ends before its step (MlflowClient.get_metric_history, once per
metric per start). A server's token (MLFLOW_TRACKING_TOKEN) reaches the node as a SkyPilot secret and
is read by MLflow from the environment.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlparse

from skyspot.trainer.metrics import hosts

DIR = "mlruns"
RUN_ID_KEY = "mlflow_run_id"
TAG = "skyspot.run_id"
# A server that does not answer must not hold the sink's thread for MLflow's default minutes of retries
# (nor print urllib3's line per retry): a failed batch is dropped and the next one tried (sink.py).
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def tracking_uri(settings, run_dir: Path) -> str:
    """A relative recipe path is a file store inside the run, kept in the store (trainer/metrics/hosts.py)."""
    named = settings.mlflow_tracking_uri
    inside = hosts.run_relative(named) if named else None
    if inside:
        return (Path(run_dir) / inside).resolve().as_uri()
    return named or os.environ.get(hosts.MLFLOW_HOST) or (Path(run_dir) / DIR).resolve().as_uri()


def _file_store(uri: str) -> Optional[Path]:
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    return None


class MLflow:
    name = "mlflow"

    def __init__(self, run_dir: Path, settings):
        self.run_dir = Path(run_dir)
        self.uri = tracking_uri(settings, self.run_dir)
        named = settings.mlflow_tracking_uri
        self._inside = (
            hosts.run_relative(named) if named else DIR if self.uri == (self.run_dir / DIR).resolve().as_uri() else None
        )
        self.client = None
        self.run_id: Optional[str] = None
        self.attempt: Optional[int] = None
        self._last: dict[str, int] = {}

    @property
    def store_key(self) -> str:
        return self._inside or DIR

    def kept_dir(self) -> Optional[Path]:
        """A file store inside the run (the default DIR, or a relative recipe path) is kept in the store;
        a store of the user's own is theirs."""
        return self.run_dir / self._inside if self._inside else None

    def open(self, ctx) -> None:
        self.attempt = ctx.attempt
        root = _file_store(self.uri)
        if root is not None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            # A store pulled from an object store lacks its empty folders, and MLflow's file store wants this one.
            (root / ".trash").mkdir(parents=True, exist_ok=True)
        dropped = hosts.drop_stray_credentials(self.uri, os.environ)
        if dropped:
            ctx.say(
                f"metrics: mlflow: {', '.join(dropped)} not sent to {self.uri}: it goes only to the server "
                f"{hosts.MLFLOW_HOST} names, over https or loopback"
            )
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient

        self.client = client = MlflowClient(tracking_uri=self.uri)
        experiment = client.get_experiment_by_name(ctx.settings.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment else client.create_experiment(ctx.settings.mlflow_experiment)
        )
        self.run_id = self._find(ctx, experiment_id)
        if self.run_id is None:
            self.run_id = client.create_run(
                experiment_id,
                run_name=ctx.run_id,
                tags={
                    TAG: ctx.run_id,
                    "skyspot.recipe": ctx.recipe.name,
                    "skyspot.fingerprint": ctx.recipe.fingerprint(),
                },
            ).info.run_id
            self._describe_run(ctx)
        else:
            client.update_run(self.run_id, status="RUNNING")
        ctx.remember(RUN_ID_KEY, self.run_id)

    def _describe_run(self, ctx) -> None:
        """The training parameters, and the recipe as an artifact (a recipe holds no secret). They also
        put a file in the run's params/ and artifacts/, which a file store needs to find the run again,
        and an object store keeps no empty folder (the copy in `<run>/mlruns/`)."""
        from mlflow.entities import Param

        train = ctx.recipe.train
        params = {
            "recipe": ctx.recipe.name,
            "model": ctx.recipe.model.hub_id or "config",
            "steps": train.steps,
            "lr": train.lr,
            "seq_len": train.seq_len,
            "micro_batch_size": train.micro_batch_size,
            "grad_accum": train.grad_accum,
            "seed": train.seed,
        }
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        self.client.log_dict(self.run_id, ctx.recipe.model_dump(mode="json"), "skyspot/recipe.json")

    def _find(self, ctx, experiment_id: str) -> Optional[str]:
        kept = ctx.recall(RUN_ID_KEY)
        if isinstance(kept, str) and kept:
            try:
                return self.client.get_run(kept).info.run_id
            except Exception:  # noqa: BLE001 - another tracking server, or the run was deleted there
                pass
        found = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{TAG}` = '{_quote(ctx.run_id)}'",
            max_results=1,
            order_by=["attributes.start_time ASC"],
        )
        return found[0].info.run_id if found else None

    def describe(self) -> str:
        return f"mlflow (run {self.run_id})"

    def has(self, tag: str, step: int) -> bool:
        if tag not in self._last:
            self._last[tag] = max((m.step for m in self.client.get_metric_history(self.run_id, tag)), default=-1)
        return step <= self._last[tag]

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])
        for tag in scalars:
            self._last[tag] = step

    def where(self, step: int, text: str, where: Mapping[str, Any]) -> None:
        self.client.set_tag(self.run_id, "skyspot.where", text)
        self.client.set_tag(self.run_id, f"skyspot.where.attempt-{self.attempt}", text)

    def flush(self) -> None:
        pass  # every call above is written when it returns

    def close(self, kind: str) -> None:
        # A preempted run is resumed by the next attempt, which sets it RUNNING again.
        self.client.set_terminated(self.run_id, "FINISHED" if kind == "complete" else "KILLED")


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")
