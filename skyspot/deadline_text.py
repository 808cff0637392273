"""A deadline as text, the form `resources.deadline` and `launch --deadline` take: read and checked.

    36h, 90m, 2d, 1h30m, 45s      a duration from launch
    2026-05-01T17:00+02:00        an ISO 8601 time (without an offset: this machine's local time)

A contract, beside recipe.py: the recipe validates its field with `check_deadline_text`, and the
deadline's policies (planning/deadline.py) read the same text with `parse_deadline`. The standard
library only, so loading a recipe stays import-light.
"""

from __future__ import annotations

import math
import re
import time
from datetime import datetime
from typing import Optional

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])", re.IGNORECASE)
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# The furthest deadline skyspot plans for: ten years. Beyond it a run is no deadline run, and far
# beyond it the arithmetic meets the calendar's end (datetime stops at year 9999).
MAX_AHEAD_SECONDS = 3650 * 86400.0
# An ISO time is read only within the years datetime and this machine's clock both hold.
_EARLIEST, _LATEST = datetime(1970, 1, 2).timestamp(), datetime(9000, 1, 1).timestamp()


class DeadlineError(ValueError):
    """A deadline that cannot be read or met; the message says what to do."""


def parse_deadline(text: str, now: Optional[float] = None) -> float:
    """`36h`, `90m`, `2d`, `1h30m`, `45s` after `now`, or an ISO 8601 time (`2026-05-01T17:00`,
    `2026-05-01T17:00+02:00`, `...Z`; without an offset, this machine's local time): unix seconds."""
    now = time.time() if now is None else now
    raw = str(text).strip()
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    compact = raw.replace(" ", "")
    if compact and _DURATION.sub("", compact) == "" and _DURATION.search(compact):
        # A number of 400 digits is no error to float(): it is infinity, which no range check would catch.
        seconds = sum(float(n) * _UNIT[u.lower()] for n, u in _DURATION.findall(compact))
        if seconds <= 0:
            raise DeadlineError(f"deadline '{shown}' is no time at all: give a duration above zero, e.g. 36h")
        if not math.isfinite(seconds) or seconds > MAX_AHEAD_SECONDS:
            raise DeadlineError(
                f"deadline '{shown}' is more than {MAX_AHEAD_SECONDS / 86400:.0f} days away: give a "
                "duration up to that (e.g. 36h, 30d) or an ISO 8601 time"
            )
        return now + seconds
    try:
        moment = datetime.fromisoformat(raw)
        stamp = moment.timestamp()  # a naive time is local time (datetime.timestamp's rule)
    except (ValueError, OverflowError, OSError) as error:
        # fromisoformat reads 9999-12-31T23:59-12:00, whose instant is in year 10000: timestamp() fails.
        if isinstance(error, ValueError) and "out of range" not in str(error):
            raise DeadlineError(
                f"deadline '{shown}' is neither a duration (36h, 90m, 2d, 1h30m) nor an ISO 8601 "
                "time (2026-05-01T17:00, 2026-05-01T17:00+02:00)"
            ) from None
        stamp = math.nan
    if not _EARLIEST <= stamp <= _LATEST:
        raise DeadlineError(
            f"deadline '{shown}' is outside the years 1970 to 9000 that skyspot reads: give a "
            "time within them (2026-05-01T17:00+02:00) or a duration (36h)"
        )
    return stamp


def check_deadline_text(text: str) -> str:
    """The recipe's validator: readable now (a time in the past is refused at launch, not here)."""
    parse_deadline(text, now=0.0)
    return text
