"""The kinds of node a run ran on, from its `node` events (trainer/node_facts.py): what `status --json`
and `cost-report` show, one entry (and in text one line) per distinct kind.

    node_kinds(log.events) -> [{"kind": "p5.48xlarge, image ami-..., python 3.12.9 (skyspot venv), ...",
                                "starts": 8, "attempts": [0, 1], "facts": {...the newest such event...}}]

Pure: events in, rows out; a `node` event without a string `kind` is left out.
"""

from __future__ import annotations

from typing import Any, Iterable

from skyspot.events import EVENT_TYPES
from skyspot.events import EventType as T

FACT_KEYS = tuple(key for key in EVENT_TYPES["node"] if key != "kind")  # the event's own field list


def node_kinds(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct kind, in the order first seen: how many node starts had it, in which attempts, and the
    newest such node's facts."""
    rows: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.get("type") != T.NODE or not isinstance(event.get("kind"), str):
            continue
        row = rows.setdefault(event["kind"], {"kind": event["kind"], "starts": 0, "attempts": [], "facts": {}})
        row["starts"] += 1
        if event.get("attempt") not in row["attempts"]:
            row["attempts"].append(event.get("attempt"))
        row["facts"] = {key: event.get(key) for key in FACT_KEYS}
    return list(rows.values())


def kind_lines(kinds: list[dict[str, Any]]) -> list[str]:
    """One line per kind, for text reports."""
    return [
        f"nodes: {row['kind']} ({row['starts']} node start{'s' if row['starts'] != 1 else ''}, "
        f"attempt{'s' if len(row['attempts']) != 1 else ''} {', '.join(map(str, row['attempts']))})"
        for row in kinds
    ]
