"""A run's status: SkyPilot's managed-job statuses, spelled as SkyPilot spells them, with behaviour.

Every status a run can have in the ledger, in `status` and in `--json` is one of RunStatus. A cloud
run's status is what SkyPilot's jobs queue last said; a local run's is what the local controller, which
plays SkyPilot's jobs controller, sets. The names and their grouping are SkyPilot's `ManagedJobStatus`
(sky/jobs/state.py:679-805 in skypilot 0.14.1): its `terminal_statuses()` and `failure_statuses()`
are `is_terminal` and `is_failed` here, and tests/test_statuses.py holds them to SkyPilot's own for
every member.

`RunStatus.from_sky` is the one reading of a status SkyPilot reports (a ManagedJobStatus, its value or
its name): status (executors/sky/sdk.py), the cost report (pricing/cost.py) and the attempts' causes
(attempts.py) all read it here. A `FAILED_*` name this version does not list (a newer SkyPilot's) is
FAILED: SkyPilot names every failure `FAILED_<why>` and counts them all as failures and terminal.

Import-light and pure: a leaf both the CLI side and the nodes may read.
"""

from __future__ import annotations

from typing import Any, Optional

from skyspot.str_enum import StrEnum


class RunStatus(StrEnum):
    """A managed job's status, SkyPilot's names (sky/jobs/state.py ManagedJobStatus), in its order."""

    PENDING = "PENDING"
    """Waiting for the jobs controller (or the local controller) to take it."""
    SUBMITTED = "SUBMITTED"
    """SkyPilot's DEPRECATED_SUBMITTED: old jobs databases still hold it (removed from use in its #5682)."""
    STARTING = "STARTING"
    """The cluster is being launched."""
    RUNNING = "RUNNING"
    """Submitted to the cluster: setting up or running."""
    WINDING_DOWN = "WINDING_DOWN"
    """SkyPilot's: all batches done, its coordinator merging outputs (skyspot's jobs do not batch)."""
    RECOVERING = "RECOVERING"
    """Being recovered: preempted or failed, a new cluster on its way."""
    CANCELLING = "CANCELLING"
    """Cancel requested; the cluster is being cleaned up."""
    SUCCEEDED = "SUCCEEDED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    """The user's program failed (and, here, any `FAILED_*` SkyPilot adds later)."""
    FAILED_SETUP = "FAILED_SETUP"
    """The setup failed: the user's script, or a deterministic cluster or runtime setup failure."""
    FAILED_PRECHECKS = "FAILED_PRECHECKS"
    """The launch failed its prechecks (no feasible resources, invalid name, identity), not capacity."""
    FAILED_NO_RESOURCE = "FAILED_NO_RESOURCE"
    """No capacity anywhere the job could run."""
    FAILED_CONTROLLER = "FAILED_CONTROLLER"
    """The controller failed (here also: the local controller died without recording an end)."""

    def is_terminal(self) -> bool:
        """Finished, one way or another: nothing more will happen to it (SkyPilot's terminal_statuses)."""
        return self in _TERMINAL

    def is_failed(self) -> bool:
        """Finished with a failure (SkyPilot's failure_statuses): FAILED and every FAILED_*."""
        return self in _FAILED

    @classmethod
    def from_sky(cls, status: Any) -> Optional[RunStatus]:
        """The status SkyPilot reports, as a RunStatus: a ManagedJobStatus member, its value or its name
        (`DEPRECATED_SUBMITTED` is SUBMITTED), case aside. A `FAILED_*` this list lacks is FAILED; anything
        else unknown (or nothing) is None, for the caller to treat as "not known"."""
        value = getattr(status, "value", status)
        if not isinstance(value, str):
            return None
        word = value.strip().upper()
        found = cls.parse(_SKY_NAMES.get(word, word))
        if found is not None:
            return found
        return cls.FAILED if word.startswith("FAILED_") else None


_FAILED = frozenset(
    {
        RunStatus.FAILED,
        RunStatus.FAILED_SETUP,
        RunStatus.FAILED_PRECHECKS,
        RunStatus.FAILED_NO_RESOURCE,
        RunStatus.FAILED_CONTROLLER,
    }
)
_TERMINAL = frozenset({RunStatus.SUCCEEDED, RunStatus.CANCELLED}) | _FAILED
# ManagedJobStatus member names that differ from their values.
_SKY_NAMES = {"DEPRECATED_SUBMITTED": "SUBMITTED"}

TERMINAL: frozenset[RunStatus] = _TERMINAL
"""Every terminal status, for membership tests over plain strings (members hash as their values)."""


def has_ended(status: Any) -> bool:
    """Whether a status as SkyPilot reports it (member, value or name) is terminal: a `FAILED_*` newer
    than this list is, an unknown word or nothing is not (it is still to be asked again)."""
    found = RunStatus.from_sky(status)
    return found is not None and found.is_terminal()
