"""Whether a local run's controller is alive: its lock, asked by `status`, `logs -f` and the foreground view.

A controller holds RUN_DIR/controller.lock from its first instant to its last (controller_lock.py); one that
died without a word (SIGKILL, out of memory, a reboot) leaves it unheld while the ledger still says the run
is going. Such a run is marked FAILED_CONTROLLER here, once, whoever asks first.
"""

from __future__ import annotations

from skyspot.executors.local import controller_lock
from skyspot.ledger import Ledger


def gone_cause(name: str) -> str:
    """Why a run whose controller died is FAILED_CONTROLLER (its ledger cause, the followers' last line)."""
    return (
        "the local controller ended without recording how the run ended (killed, out of memory or a reboot); "
        f"`skyspot resume {name}` continues it from its newest checkpoint"
    )


def controller_lock_unheld(run) -> bool:
    return bool(
        not run.terminal
        and run.run_dir
        and controller_lock.lock_path(run.run_dir).exists()
        and not controller_lock.is_held(run.run_dir)
    )


def controller_gone(ledger: Ledger, run) -> bool:
    """Whether `run`'s controller died without a word (SIGKILL, out of memory, a reboot): the ledger says
    the run is going, but no process holds its lock file. Such a run is marked FAILED_CONTROLLER, as
    SkyPilot marks a managed job whose controller is gone; `status`, `logs -f` and `launch`'s view all
    ask here. A run without a lock file (launched by an older skyspot, or not started yet) is left as it is.
    The launcher holds the lock before the ledger says PENDING, and a controller records its end before
    it lets go, so an unheld lock with a row still going is a dead controller; whether the row is still
    going is decided inside the ledger's change (`set_controller_gone`), as it may have ended meanwhile."""
    if not controller_lock_unheld(run):
        return False
    return ledger.set_controller_gone(run.name, gone_cause(run.name))
