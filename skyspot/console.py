"""The consoles: data to stdout (`out`), progress and diagnostics to stderr (`err`), colour only on a TTY.

Every module that talks to the user prints through here: the CLI and the executors alike (an executor
following a run must not import the CLI). rich honours NO_COLOR and drops colour off a TTY.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional


def _width(stream) -> Optional[int]:
    """Off a terminal rich assumes 80 columns and folds every table; use COLUMNS, else a wide page."""
    if os.environ.get("COLUMNS") or stream.isatty():
        return None
    return 160


class _LazyConsole:
    """A rich Console made on first use: importing rich costs a command that prints no rich text
    (render, --json, a plain table) a noticeable share of its start-up."""

    def __init__(self, stderr: bool):
        self._stderr = stderr
        self._console = None

    def _get(self):
        if self._console is None:
            from rich.console import Console

            stream = sys.stderr if self._stderr else sys.stdout
            self._console = Console(stderr=self._stderr, highlight=False, soft_wrap=True, width=_width(stream))
        return self._console

    @property
    def console(self):
        """The rich Console itself, for rich objects that take one (Live, Progress)."""
        return self._get()

    def __getattr__(self, name: str):
        return getattr(self._get(), name)

    def __enter__(self):
        return self._get().__enter__()

    def __exit__(self, *exc):
        return self._get().__exit__(*exc)


out: Any = _LazyConsole(stderr=False)
err: Any = _LazyConsole(stderr=True)


def is_tty() -> bool:
    """Whether a live view may draw: stdout is a terminal, outside CI."""
    return sys.stdout.isatty() and not os.environ.get("CI")
