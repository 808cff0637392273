"""Exit codes: the trainer's contract with SkyPilot (`recover_on_exit_codes`) and the local executor.

    0    COMPLETE             training finished and DIR/final/ is written
    1    ERROR                anything else: a bug, an I/O error, a rank that crashed
    2    USAGE                bad command line or recipe; nothing was started
    3    NO_VALID_CHECKPOINT  the run has committed checkpoints but none can be used (corrupt, or
                              written by another world size); nothing was started over
    75   PREEMPTED            stopped on a preemption signal (SIGTERM, SIGUSR1 or a cloud notice)
                              after the ranks wrote an emergency checkpoint together: recover me.
                              EX_TEMPFAIL from sysexits.h, "try again later". Never 137.
    76   STALE                a newer attempt of the run holds its store (fence.py): this one stopped
                              without writing more, and the run goes on there. No failure of the run,
                              and nothing to recover: not in the task's recover_on_exit_codes.
    130  INTERRUPTED          SIGINT (Ctrl-C): stopped without a checkpoint

Final endings (FINAL: complete, usage, no valid checkpoint, preempted, interrupted; and an error past
the in-place restart budget) must not be restarted in place: torchrun's agent restarts every failed
worker group whatever the code, so a worker that ends finally exits its process with 0 once its code
is in the exit record (`process_code`), and torchrun, seeing every worker succeed, exits 0 after its
exit barrier, quietly; the supervisor then exits with the recorded code. Only under torchrun with
restarts on (TORCHELASTIC_MAX_RESTARTS > 0), or under torchrun run by the supervisor (its token in the
environment), whose exit record carries the code: otherwise the process exits with the code itself.

`torchrun` exits 1 whenever a worker fails, whatever code the worker used, so the trainer also
records its code in DIR/exit.json (local rank 0 of each node, just before exiting) and
`python -m skyspot.trainer.supervise` exits with it. The supervisor trusts a record only when it
carries the token it handed to this start (SKYSPOT_SUPERVISOR_TOKEN), so a stale record from an
earlier start is never mistaken for this one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.errors import CheckpointError, UsageError

COMPLETE = 0
ERROR = 1
USAGE = 2
NO_VALID_CHECKPOINT = 3
PREEMPTED = 75
STALE = 76
INTERRUPTED = 130

MEANING = {
    COMPLETE: "training complete",
    ERROR: "error",
    USAGE: "usage error",
    NO_VALID_CHECKPOINT: "no valid checkpoint",
    PREEMPTED: "preempted: emergency checkpoint committed, recover me",
    STALE: "stale attempt: a newer attempt of the run holds its store",
    INTERRUPTED: "interrupted",
}

FINAL = frozenset({COMPLETE, USAGE, NO_VALID_CHECKPOINT, PREEMPTED, STALE, INTERRUPTED})
"""Endings a restart in place cannot help: done, the same error again, or new machines needed."""

EXIT_RECORD = "exit.json"
TOKEN_ENV = "SKYSPOT_SUPERVISOR_TOKEN"


class Preempted(Exception):
    """Raised by the loop after the emergency checkpoint: unwinds to main(), which exits PREEMPTED."""

    def __init__(self, step: int, reason: str):
        self.step = step
        super().__init__(reason)


class Superseded(Exception):
    """Raised by the loop when a newer attempt holds the run's store: unwinds to main(), which exits STALE."""

    def __init__(self, step: int, newer: int):
        self.step, self.newer = step, newer
        super().__init__(f"stale attempt at step {step}: a newer attempt (epoch {newer}) holds the run's store")


def code_for(error: BaseException) -> int:
    """The exit code for an exception that ended training."""
    if isinstance(error, Preempted):
        return PREEMPTED
    if isinstance(error, Superseded):
        return STALE
    if isinstance(error, CheckpointError):
        return NO_VALID_CHECKPOINT
    if isinstance(error, UsageError):
        return USAGE
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else ERROR
    return ERROR


def process_code(code: int, final: bool, environ=os.environ) -> int:
    """The worker process's own exit status for trainer code `code`: 0 for a final ending when torchrun
    would otherwise restart the workers, or when the supervisor that reads the exit record runs this
    torchrun (the record carries the code; a failed worker would make torchrun print its ChildFailedError
    traceback after the trainer's one line, torch/distributed/run.py `main` under `@record`)."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    except ValueError:
        restarts = 0
    supervised = bool(environ.get(TOKEN_ENV)) and bool(environ.get("TORCHELASTIC_RUN_ID"))
    return 0 if final and (restarts > 0 or supervised) else code


def describe(code: int) -> str:
    return MEANING.get(code, "error")


def write_exit_record(
    run_dir: str | os.PathLike, code: int, *, reason: str, attempt: Optional[int], step: Optional[int]
) -> Path:
    """Record this start's exit code for the supervisor (atomic replace; read after the process ends)."""
    from skyspot.trainer.files import atomic_write_json

    path = Path(run_dir) / EXIT_RECORD
    atomic_write_json(
        path,
        {
            "code": int(code),
            "meaning": describe(code),
            "reason": reason,
            "attempt": attempt,
            "step": step,
            "pid": os.getpid(),
            "ts": time.time(),
            "token": os.environ.get(TOKEN_ENV),
        },
    )
    return path


def read_exit_record(run_dir: str | os.PathLike, *, token: Optional[str], since: float) -> Optional[dict[str, Any]]:
    """This start's exit record, or None when there is none it can trust.

    Trusted when its token is ours; a record without a token (a trainer started by hand under
    an older supervisor) only when it was written after `since`.
    """
    from skyspot.trainer.files import read_json

    record = read_json(Path(run_dir) / EXIT_RECORD)
    if not isinstance(record, dict) or not isinstance(record.get("code"), int):
        return None
    if record.get("token") is not None:
        return record if token is not None and record["token"] == token else None
    ts = record.get("ts")
    return record if isinstance(ts, (int, float)) and ts >= since else None
