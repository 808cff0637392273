"""The trainer's diagnostics: one line to stderr, prefixed and flushed (stdout carries the loss lines)."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """Diagnostics go to stderr (stdout carries the loss lines)."""
    print(f"[skyspot] {line}", file=sys.stderr, flush=True)
