"""Rank faults the local executor injects: one rank SIGKILLed (`--crash-at-steps`) or SIGSTOPped
(`--hang-at-steps`) in the middle of a step, what an in-place restart (trainer/restart.py) and the
hang watchdog recover from without new machines (docs/local.md); and with `--netns`, a node's link
cut (`--cut-link-at-steps STEP[:NODE]`): every packet dropped, nothing reset, as a VM that vanished.

    STEP[:NODE[.LOCAL_RANK]]    e.g. 12 (the last rank of the last node), 12:1, 12:0.1

The fault fires once global rank 0's events show step STEP: the ranks are then in step STEP+1. The
rank's process is found among the node's processes (they carry the node's SkyPilot environment) as
the worker torchrun started with that LOCAL_RANK (TORCHELASTIC_RUN_ID in its environment).
"""

from __future__ import annotations

import signal
from typing import Optional

from skyspot.errors import UsageError
from skyspot.events import EventType as T

ACTIONS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}
FLAGS = {"crash": "--crash-at-steps", "hang": "--hang-at-steps", "cut": "--cut-link-at-steps"}
EVENT_TYPES = {"crash": T.RANK_CRASH_INJECTED, "hang": T.RANK_HANG_INJECTED, "cut": T.LINK_CUT_INJECTED}


def parse(value: Optional[str], action: str) -> list[dict]:
    """The faults of one flag's value, in step order (UsageError for a bad one)."""
    if not value:
        return []
    flag = FLAGS[action]
    faults = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        step, _, where = item.partition(":")
        node, _, local_rank = where.partition(".")
        try:
            fault = {
                "action": action,
                "step": int(step),
                "node": int(node) if node else None,
                "local_rank": int(local_rank) if local_rank else None,
            }
        except ValueError:
            raise UsageError(f"{flag} '{item}' must be STEP[:NODE[.LOCAL_RANK]], e.g. 12, 12:1 or 12:0.1") from None
        if action == "cut" and fault["local_rank"] is not None:
            raise UsageError(f"{flag} '{item}' must be STEP[:NODE]: a link is a node's, not a rank's")
        if fault["step"] < 1 or any(fault[k] is not None and fault[k] < 0 for k in ("node", "local_rank")):
            raise UsageError(f"{flag} '{item}': steps start at 1, nodes and local ranks at 0")
        faults.append(fault)
    return sorted(faults, key=lambda f: f["step"])


def check(faults: list[dict], num_nodes: int, ranks_per_node: int) -> None:
    """Refuse a fault aimed at a node or local rank the run does not have."""
    for fault in faults:
        if fault["node"] is not None and fault["node"] >= num_nodes:
            raise UsageError(f"{FLAGS[fault['action']]}: node {fault['node']} of a run on {num_nodes} node(s)")
        if fault["local_rank"] is not None and fault["local_rank"] >= ranks_per_node:
            raise UsageError(
                f"{FLAGS[fault['action']]}: local rank {fault['local_rank']} of {ranks_per_node} rank(s) per node"
            )


def workers(run_name: str, node: int) -> dict[int, "object"]:
    """The node's live trainer workers by LOCAL_RANK (psutil processes)."""
    import psutil

    found = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if (
                env.get("SKYSPOT_RUN_NAME") != run_name
                or env.get("SKYPILOT_NODE_RANK") != str(node)
                or "TORCHELASTIC_RUN_ID" not in env
                or "LOCAL_RANK" not in env
                or proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
            ):
                continue
            found[int(env["LOCAL_RANK"])] = proc
        except (psutil.Error, OSError, ValueError):
            continue
    return found


def inject(fault: dict, run_name: str, num_nodes: int, hosts=None) -> Optional[dict]:
    """Signal the fault's rank (or cut its node's link on `hosts`, netns.Hosts); its event fields, or None
    when that rank has no live worker now (the workers are restarting, say): the caller tries again at
    its next poll."""
    import psutil

    node = num_nodes - 1 if fault["node"] is None else fault["node"]
    if fault["action"] == "cut":
        hosts.cut(node)
        return {"node": node, "address": hosts.addr(node), "signal": "link cut"}
    ranks = workers(run_name, node)
    local_rank = max(ranks) if fault["local_rank"] is None and ranks else fault["local_rank"]
    proc = ranks.get(local_rank)
    if proc is None:
        return None
    sig = ACTIONS[fault["action"]]
    try:
        proc.send_signal(sig)
    except psutil.Error:
        return None
    return {"node": node, "local_rank": local_rank, "pid": proc.pid, "signal": sig.name}
