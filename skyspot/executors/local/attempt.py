"""One local attempt's stages and what it knows: the data of the controller's state machine.

The controller (executors/local/controller.py) moves an attempt through these stages with one function per
transition, its WATCH table saying what each stage watches for, and AFTER_ATTEMPT what the run does after
each outcome; here is only what those functions read and write.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Optional

from skyspot.attempts import AttemptEnd
from skyspot.events import EventWriter, FileTail


class Stage(Enum):
    """Where an attempt's nodes are while the controller watches them; WATCH says what each stage watches
    for, and each check's function returns the stage it moves the attempt to."""

    RUNNING = "running"
    """The nodes run and nothing was sent to them."""
    NOTICED = "noticed"
    """The simulated cloud announced a preemption; its SIGTERM (if it sends one) has not come yet."""
    PREEMPTING = "preempting"
    """The cloud's SIGTERM came; the VM goes at the timeline's kill."""
    CANCELLING = "cancelling"
    """`cancel`: the controller sent SIGTERM; SIGKILL after its grace (or when a noticed VM goes)."""
    SWITCHING = "switching"
    """A deadline wants the other capacity: the controller sent SIGTERM; SIGKILL after its grace."""


class Ending(NamedTuple):
    """How an attempt ended: what `attempt_end` records and AFTER_ATTEMPT dispatches on."""

    code: int
    outcome: AttemptEnd
    """complete, cancelled, setup_failed, preempted, switched or error (AFTER_ATTEMPT's keys; the
    `attempt_end` record's reason, read back by skyspot.attempts)."""
    node_codes: list
    cause: Optional[str] = None


@dataclass
class Attempt:
    """What one attempt knows: what it was given at its start, then what happened while it was watched."""

    number: int
    spot: bool
    nodes: int
    where: dict
    events: EventWriter
    metadata: Any
    """The run's MetadataServer, reset for this attempt."""
    started: float
    port: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)
    stage: Stage = Stage.RUNNING
    step: int = 0
    """The newest step rank 0 logged."""
    steps_tail: Optional[FileTail] = None
    notice_at: Optional[float] = None
    """When the simulated cloud announced the preemption."""
    stop_at: Optional[float] = None
    """When the controller itself sent SIGTERM (cancel, a deadline's switch)."""
    killed_at: Optional[float] = None
    """When the nodes got SIGKILL (the VM gone, or the grace over)."""
    first_failure: Optional[float] = None
    first_step_at: Optional[float] = None
    """When rank 0 logged this attempt's first step (its restart ends there)."""
    first_step: int = 0
    """That step's number (the step time is measured from it)."""
    """When a node first exited non-zero."""


ENDED_BY: dict[Stage, Optional[AttemptEnd]] = {
    Stage.RUNNING: None,
    Stage.NOTICED: AttemptEnd.PREEMPTED,
    Stage.PREEMPTING: AttemptEnd.PREEMPTED,
    Stage.CANCELLING: AttemptEnd.CANCELLED,
    Stage.SWITCHING: AttemptEnd.SWITCHED,
}
"""The outcome of an attempt whose nodes exited non-zero in each stage (None: their exit code says)."""
