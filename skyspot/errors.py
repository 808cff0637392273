"""The project's error types. Domain code raises these; only the CLI turns them into one line."""

from __future__ import annotations

from typing import Optional

EXIT_FAILURE = 1
"""A command or process that failed for a reason other than its input."""
EXIT_USAGE = 2
"""Bad input or bad usage: what the user (or a recipe) must change; the one usage exit code of every skyspot
command and entry point, as Click's own usage errors and SkyPilot's JobExitCode give usage its own code."""


class SkyspotError(Exception):
    """A failure the user can act on; the message is one line that says what to do next."""

    exit_code = EXIT_FAILURE


class UsageError(SkyspotError):
    """Bad input from the user: a malformed recipe, an unknown name, a bad override or URL."""

    exit_code = EXIT_USAGE


class RecipeError(UsageError):
    """A recipe that does not load or validate. `problems` lists every problem found, not only the first."""

    def __init__(self, source: Optional[str], problems: list[str]):
        """`source` None: every problem is the user's override, not the file's, and names itself."""
        self.source = source
        self.problems = list(problems)
        super().__init__((f"{source}: " if source else "") + "; ".join(self.problems))


class StoreError(SkyspotError):
    """The run's store (bucket or directory) cannot be reached or used."""


class CheckpointError(SkyspotError):
    """No checkpoint can be used where one is required (e.g. every checkpoint of a run is corrupt)."""


class NoCloudError(SkyspotError):
    """SkyPilot has no enabled cloud to launch on."""
