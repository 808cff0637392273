"""Spot traces: a file of preemption times the local executor replays.

Format (YAML; see `traces/example.yaml` and docs/local.md):

    # seconds since the run was launched at which the cloud sends a preemption notice
    preemptions: [45, 120, 200]
    # optional: seconds between notice and SIGTERM for this trace (else --notice)
    notice: 30
    # optional: after this many preemptions spot capacity is gone; later attempts run on-demand
    capacity_gone_after: 3
    # optional: spot nodes granted to each attempt in turn (the last repeats); below the recipe's
    # resources.num_nodes the trainer resumes at the smaller world size (needs resources.min_nodes)
    nodes: [2, 1, 2]

Times count wall-clock from the launch, as a cloud's interruption log would. A notice
that falls while the run is between attempts (provisioning) is delivered to the next
attempt at once, as a cloud would preempt a freshly granted instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from skyspot.errors import UsageError


@dataclass
class SpotTrace:
    preemptions: list[float] = field(default_factory=list)
    notice: Optional[float] = None
    capacity_gone_after: Optional[int] = None
    nodes: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> "SpotTrace":
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise UsageError(f"cannot read spot trace '{path}': {error.strerror}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise UsageError(f"{where}: malformed spot trace YAML") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: a spot trace is a mapping with a 'preemptions' list (see docs/local.md)")
        unknown = set(data) - {"preemptions", "notice", "capacity_gone_after", "nodes"}
        if unknown:
            raise UsageError(f"{path}: unknown spot trace key(s) {', '.join(sorted(unknown))} "
                             "(known: preemptions, notice, capacity_gone_after, nodes)")
        times = data.get("preemptions") or []
        if not isinstance(times, list) or not all(isinstance(t, (int, float)) and t >= 0 for t in times):
            raise UsageError(f"{path}: 'preemptions' must be a list of seconds >= 0")
        notice = data.get("notice")
        if notice is not None and (not isinstance(notice, (int, float)) or notice < 0):
            raise UsageError(f"{path}: 'notice' must be seconds >= 0")
        gone = data.get("capacity_gone_after")
        if gone is not None and (not isinstance(gone, int) or gone < 0):
            raise UsageError(f"{path}: 'capacity_gone_after' must be a whole number >= 0")
        nodes = data.get("nodes") or []
        if not isinstance(nodes, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                  for n in nodes):
            raise UsageError(f"{path}: 'nodes' must be a list of node counts >= 1 (one per spot attempt)")
        return cls(sorted(float(t) for t in times), None if notice is None else float(notice), gone, nodes)
