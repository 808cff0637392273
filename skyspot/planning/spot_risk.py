"""How often spot capacity is taken away, per place: the preemption history every placement reads.

    history = read_history()                       # every local run in $SKYSPOT_HOME's ledger
    risk = rate_for(history, "aws", region=None, instance_type="p5.48xlarge", spot=True, accelerator="H100:8")
    risk.per_node_hour, risk.source                 # 0.4, "prior 1 in 6 node-h (ours) x 1 (AWS Spot Advisor, any
                                                    #   region: ...) + 3 preemptions in 4.0 node-h observed ..."

- Exposure: each attempt of every run the ledger knows whose events are on this machine (a run's
  directory, or a cloud run's events as `status` or `cost-report` last read them from its store: the copy
  of events_copy.py; the store itself is not read: no network at planning time), split by attempts.py
  (the one reader of attempts) into where it ran (cloud, region, zone, instance type, spot), its uptime
  in node-hours and whether it ended preempted. A simulated place (the local executor standing in for a
  cloud) is left out: it says nothing about that cloud's capacity.
- Decay: each attempt weighs 0.5 ** (age / HALF_LIFE_S), its age counted from its end. Seven days: spot
  capacity of a type in a zone shifts over days (interruptions come in bursts, Spot-and-Scoot 2026), and
  AWS's Spot Instance Advisor summarises a trailing month; with a week's half-life a month-old preemption
  weighs about 1/16 and last night's almost 1.
- Published signal: the cloud's published figure for the candidate's instance type and region, where
  there is one (planning/spot_signals.py: AWS Spot Advisor's bucket against the type's median over its
  regions, a multiplier between 0.5 and 2), scales the prior's rate: its node-hours are divided by it.
- Blend (Gamma-Poisson): preemptions are Poisson in node-hours with an unknown rate; the cloud's prior
  (clouds/priors.py: `prior_node_hours` per accelerator class, ours), scaled as above, is a Gamma with
  PRIOR_EVENTS pseudo-preemption in that many pseudo-node-hours. The posterior mean is
  (PRIOR_EVENTS + decayed preemptions) / (prior node-hours / multiplier + decayed node-hours): the
  scaled prior with no history, the observed rate once the history outweighs it.
- On-demand capacity is not preempted: rate 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

if TYPE_CHECKING:
    from skyspot.planning.spot_signals import Published

HALF_LIFE_S = 7 * 24 * 3600.0
PRIOR_EVENTS = 1.0
"""The prior's weight: one pseudo-preemption in the prior's node-hours (a weak prior, the history wins fast)."""

Place = tuple[str, str, str, str, bool]
"""(cloud, region, zone, instance type, spot); "" where the events do not say."""


@dataclass
class Exposure:
    """Decayed preemptions and node-hours observed at one place (and the raw counts, for the text)."""

    preemptions: float = 0.0
    node_hours: float = 0.0
    raw_preemptions: int = 0
    raw_node_hours: float = 0.0

    def add(self, other: "Exposure") -> None:
        self.preemptions += other.preemptions
        self.node_hours += other.node_hours
        self.raw_preemptions += other.raw_preemptions
        self.raw_node_hours += other.raw_node_hours


@dataclass
class History:
    """Every place's exposure, as of `now`."""

    now: float
    places: dict[Place, Exposure] = field(default_factory=dict)

    def matching(self, cloud: str, *, region: Optional[str], instance_type: Optional[str], spot: bool) -> Exposure:
        """The exposure of every place a candidate may land on: its cloud and capacity, its region when it
        names one (else any), its instance type when both sides know it."""
        total = Exposure()
        for (c, r, _zone, itype, s), exposure in self.places.items():
            if (
                c != cloud
                or s != spot
                or (region and r != region)
                or (instance_type and itype and itype != instance_type)
            ):
                continue
            total.add(exposure)
        return total


@dataclass(frozen=True)
class Risk:
    """A candidate's expected preemptions per node-hour, and where the figure comes from."""

    per_node_hour: float
    source: str
    """"prior ... (ours)", the published signal's multiplier and its source (or why there is none),
    "+ N preemptions in H node-h observed"; "on-demand: not preempted" for on-demand."""
    observed: Exposure = field(default_factory=Exposure)
    prior_per_node_hour: float = 0.0
    """The cloud's prior (ours), before the published signal scales it."""
    published: Optional["Published"] = None
    """The published signal or why there is none (planning/spot_signals.py); None for on-demand."""


def weight(ended_at: float, now: float) -> float:
    """The decay of an attempt that ended at `ended_at`: 1 now, 1/2 after HALF_LIFE_S."""
    return float(0.5 ** (max(0.0, now - ended_at) / HALF_LIFE_S))


def add_attempts(history: History, events: Iterable[Mapping[str, Any]], *, num_nodes: int = 1) -> None:
    """Add one run's attempts (its events, any order) to `history`."""
    from skyspot.attempts import is_simulated, split

    for attempt in split(sorted(events, key=lambda e: e.get("ts", 0.0)), now=history.now):
        where = attempt.where or {}
        if is_simulated(where) or not where.get("cloud"):
            continue
        stated = where.get("num_nodes")
        nodes: int = stated if isinstance(stated, int) and not isinstance(stated, bool) else num_nodes
        hours = attempt.uptime_s / 3600 * max(1, nodes)
        preempted = int(attempt.spot and attempt.preempted)
        w = weight(attempt.end, history.now)
        place = (
            str(where.get("cloud")).lower(),
            str(where.get("region") or ""),
            str(where.get("zone") or ""),
            str(where.get("instance_type") or ""),
            attempt.spot,
        )
        history.places.setdefault(place, Exposure()).add(Exposure(w * preempted, w * hours, preempted, hours))


def read_history(*, now: Optional[float] = None) -> History:
    """The history of every run in $SKYSPOT_HOME's ledger whose events are on this machine (its run
    directory, or the copy of a cloud run's store events that status or cost-report last read)."""
    from skyspot import events_copy
    from skyspot.events import EVENTS_DIR, read_events_dir
    from skyspot.ledger import Ledger

    from skyspot.ledger import skyspot_home

    history = History(time.time() if now is None else now)
    if not (skyspot_home() / "ledger.db").is_file():  # no run yet: the prior, and no ledger made for it
        return history
    with Ledger() as ledger:
        runs = ledger.runs()
    for run in runs:
        # The local executor's places are all simulated (attempts.is_simulated drops them): not read at all,
        # so a machine full of local runs does not slow every launch and render down.
        if run.executor == "local":
            continue
        if run.run_dir and Path(run.run_dir, EVENTS_DIR).is_dir():
            log = read_events_dir(Path(run.run_dir) / EVENTS_DIR)
            for node_events in sorted(Path(run.run_dir).glob(f"nodes/node-*/{EVENTS_DIR}")):
                log.merge(read_events_dir(node_events))
        elif events_copy.exists(run.name):  # a cloud run, as status last read it from its store
            log = events_copy.read(run.name)
        else:
            continue
        add_attempts(history, log.events, num_nodes=run.num_nodes or 1)
    return history


def rate_for(
    history: Optional[History],
    cloud: str,
    *,
    region: Optional[str],
    instance_type: Optional[str],
    spot: bool,
    accelerator: Optional[str],
) -> Risk:
    """The blended preemption rate per node-hour of a candidate (module docstring)."""
    if not spot:
        return Risk(0.0, "on-demand: not preempted")
    from skyspot.clouds.priors import mtbp_prior
    from skyspot.planning.spot_signals import Signal, signal_for

    prior = mtbp_prior(cloud, accelerator)
    prior_hours = prior.per_node_s / 3600
    published = signal_for(cloud, region, instance_type)
    seen = history.matching(cloud, region=region, instance_type=instance_type, spot=True) if history else Exposure()
    rate = (PRIOR_EVENTS + seen.preemptions) / (prior_hours / published.multiplier + seen.node_hours)
    if isinstance(published, Signal):
        source = f"prior 1 in {prior_hours:g} node-h (ours) {published.text()}"
    else:
        source = f"prior 1 in {prior_hours:g} node-h (ours; {published.text()})"
    if seen.raw_node_hours > 0 or seen.raw_preemptions:
        source += (
            f" + {seen.raw_preemptions} preemption{'s' if seen.raw_preemptions != 1 else ''} in "
            f"{seen.raw_node_hours:,.1f} node-h observed (decayed: {seen.preemptions:.2g} in "
            f"{seen.node_hours:,.1f}; half-life {HALF_LIFE_S / 86400:g} d)"
        )
    return Risk(rate, source, seen, PRIOR_EVENTS / prior_hours, published)
