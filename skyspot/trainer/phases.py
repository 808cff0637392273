"""What one start of the trainer holds, declared up front and typed by phase (as torchtitan's Trainer
declares its components): what setup made (`Started`), what build and resume made (`Built`), and the
little that changes while training (`Progress`). `Run` is the three together; a field that is None is
None by role (a node leader's lock, a store's uploader), never because a phase has not filled it yet.

Only `Run.ckpt` is set part-way through a phase: build opens the checkpoint manager first, and
cleanup must close it even when the rest of build failed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch, DeepSpeed and transformers load after setup's GPU check (loop.setup)
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from skyspot.events import EventWriter
    from skyspot.recipe import Recipe
    from skyspot.trainer.base import BaseModel
    from skyspot.trainer.checkpoint import CheckpointManager, Restored
    from skyspot.trainer.cluster import Placement
    from skyspot.trainer.comm import Comm
    from skyspot.trainer.data import DataOrder, Samples
    from skyspot.trainer.durable import StoreTier
    from skyspot.trainer.evaluate import Evaluator
    from skyspot.trainer.metrics import MetricsSink
    from skyspot.trainer.model import ByteTokenizer
    from skyspot.trainer.notice import Watcher
    from skyspot.trainer.preemption import PreemptionWatch, SavePredictor
    from skyspot.trainer.process_env import ProcessEnv
    from skyspot.trainer.restart import Generation
    from skyspot.trainer.rundir import RunLock
    from skyspot.trainer.uploader import Uploader


@dataclass(frozen=True)
class Started:
    """What setup made, on this rank: every field decided once, before the model is built."""

    args: argparse.Namespace
    """The command line as parsed (never changed; `fresh` says what this start does)."""
    env: ProcessEnv
    """The environment as the start left it (process_env.py)."""
    recipe: Recipe
    """The recipe as loaded with its overrides (build reconciles it with the checkpoint: Built.recipe)."""
    placement: Placement
    run_id: str
    attempt: int
    fresh: bool
    """--fresh, except on a restart in place, which continues its attempt."""
    events: EventWriter
    comm: Comm
    watch: PreemptionWatch
    device: torch.device
    generation: Generation
    """Which start of the workers within this node's start this is (restart.py: restarts in place)."""
    lock: Optional[RunLock]
    """The run directory's lock, on node leaders."""
    tier: Optional[StoreTier]
    """The run's store, when it has one (every rank)."""
    uploader: Optional[Uploader]
    """The node's upload worker, on node leaders when the run has a store."""
    notice_watcher: Optional[Watcher]
    """The node leader's notice watcher, when no supervisor runs it (loop._start_notice_watcher)."""
    metrics: Optional[MetricsSink] = None
    """Global rank 0's dashboards (metrics.backends), fed from its own events (trainer/metrics/)."""
    backend: str = "gloo"
    """The process group's backend (nccl on GPUs, gloo on CPU ranks)."""
    nccl_log: Optional[Path] = None
    """Where the node leader's NCCL writes its INIT/NET lines (fabric.prepare), read by the fabric probe."""
    where: dict[str, Any] = field(default_factory=dict)
    """Where this node runs as the start event says it (its instance type: the fabric probe's expected figure)."""

    @property
    def run_dir(self) -> Path:
        return self.args.run_dir

    def emit(self, type: str, **fields: Any) -> None:
        """Run-level events come from global rank 0."""
        if self.placement.is_global_zero and self.events is not None:
            self.events.emit(type, **fields)


@dataclass(frozen=True)
class Built:
    """What build made: the resume point restored into data, model and engine."""

    recipe: Recipe
    """The recipe to continue with: the architecture from the checkpoint, the batch re-split (resume.py)."""
    ckpt: CheckpointManager
    base: BaseModel
    """Where the pretrained model's files are on this node (hub models)."""
    tokenizer: ByteTokenizer | PreTrainedTokenizerBase
    samples: Samples
    """The training set, without the held-out part."""
    order: DataOrder
    evaluator: Optional[Evaluator]
    """The held-out set's evaluations, when the recipe names one (evaluate.py)."""
    keepalive: object
    """What build_model keeps alive beside the model (model.py)."""
    engine: DeepSpeedEngine
    resumed: Optional[Restored]
    """The checkpoint this start resumed from; None on a start from step 0."""
    predictor: SavePredictor
    """How long an emergency save takes to be safe, as measured (every rank)."""


@dataclass(frozen=True)
class EarlyCheckpoint:
    """The checkpoint taken at a notice before any save was measured: it secures the steps so far."""

    step: int
    at: float
    """The vote's clock when it was asked for."""


@dataclass
class NoticeWindow:
    """Once the ranks agreed on a notice: its step, time, deadline and how training through it went."""

    step: int
    """The step at which the ranks first agreed on it."""
    first_seen: Optional[float]
    deadline: Optional[float]
    held: int = 0
    """Step boundaries at which training went on."""
    early: Optional[EarlyCheckpoint] = None
    checkpoint_now: bool = False
    """The early checkpoint is asked for and not yet saved (take_checkpoint_now)."""
    predicted_seconds: Optional[float] = None
    """The last vote's predicted step plus save to safety (None: nothing measured)."""

    def take_checkpoint_now(self) -> bool:
        """Whether the loop must save the early checkpoint now; asked once."""
        now, self.checkpoint_now = self.checkpoint_now, False
        return now


@dataclass
class Progress:
    """What changes while the loop runs."""

    step: Optional[int] = None
    """The step the loop is at (None until it starts)."""
    notice: Optional[NoticeWindow] = None
    """Once the ranks agreed on a notice: how training through its window goes (notice_window.py)."""
    upload_deadline: Optional[float] = None
    """Set by the emergency path: uploads end by then."""
    final: Optional[Path] = None
    """DIR/final/ once global rank 0 wrote it (uploaded on the way out)."""


@dataclass
class Run:
    """One start of the trainer on this rank: setup's record, build's once it is done, the loop's progress."""

    started: Started
    ckpt: Optional[CheckpointManager] = None
    """Opened first in build (closed by cleanup even when build failed after it); Built.ckpt once built."""
    built: Optional[Built] = None
    progress: Progress = field(default_factory=Progress)

    @property
    def placement(self) -> Placement:
        return self.started.placement

    @property
    def run_dir(self) -> Path:
        return self.started.run_dir

    @property
    def trained(self) -> Built:
        """Build's record; only the loop and what follows it ask (after build)."""
        assert self.built is not None, "build() has not run"
        return self.built

    @property
    def engine(self) -> DeepSpeedEngine:
        return self.trained.engine

    @property
    def order(self) -> DataOrder:
        return self.trained.order

    @property
    def step(self) -> Optional[int]:
        return self.progress.step

    def emit(self, type: str, **fields: Any) -> None:
        """Run-level events come from global rank 0."""
        self.started.emit(type, **fields)
