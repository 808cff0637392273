"""What every benchmark shares: repeats, min/median/max, the machine's description, and results."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class Figure:
    """One measured quantity over repeats, with its goal (if any) and whether it was met."""

    bench: str
    name: str
    unit: str
    values: list[float]
    goal: Optional[str] = None
    met: Optional[bool] = None
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def row(self) -> dict:
        return {
            "bench": self.bench,
            "name": self.name,
            "unit": self.unit,
            "min": min(self.values),
            "median": self.median,
            "max": max(self.values),
            "n": len(self.values),
            "goal": self.goal or "",
            "met": {None: "", True: "yes", False: "NO"}[self.met],
            "note": self.note,
        }


@dataclass
class Section:
    """A block of docs/benchmarks.md a benchmark rewrites between its own two markers (bench/__main__.py
    writes it, with the results, and only without --no-write)."""

    start: str
    end: str
    block: str
    """The text from `start` to `end`, both markers included."""


@dataclass
class Results:
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        return figure


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        values.append(time.perf_counter() - start)
    return values


def machine() -> dict:
    try:
        import psutil

        memory = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:  # pragma: no cover
        memory = "?"
    disk = shutil.disk_usage(os.getcwd())
    return {
        "cores": os.cpu_count(),
        "memory": memory,
        "disk_free": f"{disk.free / 2**30:.0f} GiB",
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
