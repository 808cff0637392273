"""The consoles: data to stdout (`out`), progress and diagnostics to stderr (`err`), colour only on a TTY.

Every module that talks to the user prints through here: the CLI and the executors alike (an executor
following a run must not import the CLI). rich honours NO_COLOR and drops colour off a TTY.

Text printed through a console never carries a control character to the terminal: a ledger row's
`cause`, a run name or an error message may hold an escape sequence (a window title, a clear screen,
a cursor move), and `printable` is the one function that escapes them, here for every string a console
prints and in cli/common.py for every table cell and error line. Rich strips only a few controls itself
(BEL, BS, VT, FF, CR), not ESC.
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


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` with every control character (ESC, CR, C1 codes, DEL, ...) and everything else that is
    not printable written as a Python escape (`\\x1b`), so it shows instead of acting on the terminal;
    line breaks too unless `keep_newlines` (an error stays one line whatever the user typed)."""
    if text.isprintable():
        return text
    return "".join(
        c
        if c.isprintable() or c == " " or (keep_newlines and c in "\n\t")
        else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        for c in text
    )


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

    def print(self, *objects: Any, **kwargs: Any) -> None:
        self._get().print(*(printable(o, keep_newlines=True) if isinstance(o, str) else o for o in objects), **kwargs)

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
