"""Metrics to the user's dashboards: TensorBoard, Weights & Biases, MLflow (`metrics.backends`).

Global rank 0 only, and fed from the run's own events, so the trainer has one hook: `attach` taps the
rank's EventWriter, and every `start`, `resume`, `step` (every `metrics.every_steps`) and `eval` it
writes reaches the sink, which fans the scalars out to the backends from a thread of its own (a slow or
unreachable dashboard never holds a step):

    sink = attach(run, say)          # setup(), global rank 0, when metrics.backends is not empty
    ...                              # the run's events flow in as they are written
    sink.close(code)                 # cleanup(), before the uploader's last sync

One module per backend (`to_tensorboard`, `to_wandb`, `to_mlflow`), the fan-out in `sink`, the spot
story (preemptions and cost so far, where the run is) in `spot`. What each backend keeps across
attempts and how none draws a step twice: docs/trainer.md, "Metrics".
"""

from __future__ import annotations

from skyspot.trainer.metrics.sink import MetricsSink, attach

__all__ = ["MetricsSink", "attach"]
