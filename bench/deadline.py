"""Benchmark: deadlines. Cost against all on-demand and against greedy, and deadline misses (goal 0).

    python -m bench --only deadline            # about 20 minutes on 2 cores
    python -m bench --only deadline --quick    # one trace on the local executor, a third of the random traces
                                               # (`python -m bench --quick` leaves it out: bench/__main__.py)

Three parts, written to docs/benchmarks.md (section 8, between its markers):

1. The five shipped traces on the real local executor: `skyspot launch tiny --local --spot-trace
   traces/T.yaml --deadline 260s train.steps=300`, each step slowed to about 0.33 s (the
   trainer's test fault hook), under the default policy. Cost, all on-demand and greedy are what
   `skyspot cost-report RUN --json` says: the run's own estimated cost, the on-demand baseline,
   and greedy replayed on the same trace with the run's measured step time and restart overhead.
2. The same traces stretched 600x (1 s = 10 min) in the simulator at Can't Be Late's setting
   (section 6.1: 48 h of work, a 0.2 h changeover, job fractions 0.75 and 0.9), every policy.
3. Random availability traces in the simulator (seeded; spot lifetimes 2, 6 and 12 h, outages
   0.5, 2 and 6 h, job fractions 0.6, 0.75 and 0.9) at changeovers of 0.2, 1 and 3 h: the
   measurement behind `adaptive` (skyspot/planning/deadline.py).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import tempfile
import time

from bench._launch import BIN, REPO, bench_env, ensure_shm_op
from bench.common import Figure, Results, Section, machine

from skyspot.planning import deadline as dl
from skyspot.executors.local.spot_trace import SpotTrace

TRACES = ["calm", "outage", "flaky", "evening", "diurnal"]
QUICK_TRACES = ["outage"]
LOCAL = [
    "--deadline",
    "260s",
    "--provision-delay",
    "2",
    "--grace",
    "60",
    "train.steps=300",
    "checkpoint.every_steps=50",
    "train.log_every=100",
    "resources.step_seconds_hint=0.33",
]
PACE = "step_end/0:pause=0.25"
HOUR = 3600.0
START, END = "<!-- deadline results: written by `python -m bench --only deadline` -->", "<!-- /deadline results -->"
# Can't Be Late, Table 5 (real workloads on SkyPilot; cost vs on-demand under Uniform Progress), and
# section 7.2 (ML training, loose deadline: greedy saved 15 %, Uniform Progress 48 %, Omniscient 55 %).
PAPER = [
    ("ML training, p3.2xlarge, AWS", "-41 %", "-48 %"),
    ("Bioinformatics, c3-highcpu-88, GCP", "-63 %", "-84 %"),
    ("Data analytics, r5.16xlarge, AWS", "-27 %", "-32 %"),
]


def run(results: Results, quick: bool) -> None:
    sections = [
        _local(results, QUICK_TRACES if quick else TRACES),
        _stretched(results),
        _random(results, per_cell=2 if quick else 6),
    ]
    results.sections.append(_section(sections, quick))


# --------------------------------------------------------------------------- 1. the local executor


def _local(results: Results, traces: list[str]) -> str:
    ensure_shm_op(results)
    rows, misses, ratios_od, ratios_greedy = [], 0, [], []
    with tempfile.TemporaryDirectory(prefix="skyspot-bench-deadline-") as home:
        env = bench_env(SKYSPOT_HOME=home, SKYSPOT_FAULT=PACE)
        for name in traces:
            run = f"dl-{name}"
            started = time.time()
            proc = subprocess.run(
                [
                    str(BIN / "skyspot"),
                    "launch",
                    "tiny",
                    "--local",
                    "-n",
                    run,
                    "--spot-trace",
                    str(REPO / "traces" / f"{name}.yaml"),
                    *LOCAL,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            wall = time.time() - started
            if proc.returncode != 0:
                rows.append(f"| {name} | failed (exit {proc.returncode}) | | | | | | |")
                misses += 1
                continue
            report = json.loads(
                subprocess.run(
                    [str(BIN / "skyspot"), "cost-report", run, "--json"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )[0]
            d = report["deadline"]
            met = bool(d.get("met"))
            misses += not met
            od, greedy, cost = d["all_on_demand_usd"], d["greedy_usd"], d["cost_usd"]
            ratios_od.append(cost / od)
            ratios_greedy.append(cost / greedy)
            margin = d["deadline"] - d["finished_at"]
            rows.append(
                f"| {name} | {'yes' if met else 'NO'} ({margin:+.0f} s) | ${cost:.4f} | ${od:.4f} | "
                f"{cost / od:.2f} | ${greedy:.4f} ({'met' if d['greedy_met'] else 'MISSED'}) | "
                f"{cost / greedy:.2f} | {_n(len(report['attempts']), 'attempt')}, {report['preemptions']} "
                f"preempted, {_spot_share(report):.0f} % of billed time on spot; {wall:.0f} s |"
            )
    results.add(
        Figure(
            "deadline",
            "local replays: deadline misses",
            "runs",
            [float(misses)],
            goal="0",
            met=misses == 0,
            note=f"{len(traces)} traces, tiny, default policy ({dl.DEFAULT_POLICY})",
        )
    )
    if ratios_od:
        results.add(
            Figure(
                "deadline",
                "local replays: cost / all on-demand",
                "x",
                ratios_od,
                goal="<= 1",
                met=max(ratios_od) <= 1.0,
                note="per trace; docs/benchmarks.md section 8",
            )
        )
        results.add(
            Figure(
                "deadline",
                "local replays: cost / greedy (replayed)",
                "x",
                ratios_greedy,
                note="greedy replayed on the same trace with the run's measured step time and restarts",
            )
        )
    header = (
        "| trace | deadline met (margin) | this run | all on-demand | ratio | greedy, same trace | ratio | "
        "run |\n|---|---|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _spot_share(report: dict) -> float:
    total = sum(a["seconds"] for a in report["attempts"]) or 1.0
    return 100 * sum(a["seconds"] for a in report["attempts"] if a["spot"]) / total


# --------------------------------------------------------------------------- 2. stretched traces


def _stretched(results: Results) -> str:
    lines, wins = [], []
    for name in TRACES:
        trace = _stretch(SpotTrace.load(REPO / "traces" / f"{name}.yaml"), 600.0)
        for fraction in (0.75, 0.9):
            job = dl.Job(
                steps=480,
                step_seconds=360.0,
                deadline=48 * HOUR / fraction,
                restart_seconds=0.2 * HOUR,
                spot_usd_per_hour=1.0,
                on_demand_usd_per_hour=3.59,
            )
            od = dl.simulate(job, trace, dl.ALL_ON_DEMAND, tick=60, period=300).cost_usd
            out = {p: dl.simulate(job, trace, p, tick=60, period=300) for p in dl.POLICIES}
            cells = " | ".join(f"{out[p].cost_usd / od:.3f}{'' if out[p].met else ' MISSED'}" for p in dl.POLICIES)
            versus = out[dl.DEFAULT_POLICY].cost_usd / out["greedy"].cost_usd
            wins.append(versus)
            lines.append(f"| {name} | {fraction} | {cells} | {100 * (1 - versus):+.0f} % |")
    misses = sum(1 for line in lines if "MISSED" in line)
    results.add(
        Figure(
            "deadline",
            "stretched traces (sim): deadline misses",
            "runs",
            [float(misses)],
            goal="0",
            met=misses == 0,
            note="5 traces x 2 job fractions x 3 policies, Can't Be Late's setting",
        )
    )
    results.add(
        Figure(
            "deadline",
            f"stretched traces (sim): {dl.DEFAULT_POLICY} / greedy",
            "x",
            wins,
            note="cost ratio per trace and job fraction",
        )
    )
    header = (
        "| trace | job fraction | "
        + " | ".join(f"{p} / on-demand" for p in dl.POLICIES)
        + f" | {dl.DEFAULT_POLICY}: saved vs greedy |\n|---|---|"
        + "---|" * (len(dl.POLICIES) + 1)
        + "\n"
    )
    return header + "\n".join(lines)


def _stretch(trace: SpotTrace, factor: float) -> SpotTrace:
    return SpotTrace(
        preemptions=[t * factor for t in trace.preemptions],
        unavailable=[(a * factor, b * factor) for a, b in trace.unavailable],
        capacity_gone_after=trace.capacity_gone_after,
    )


# --------------------------------------------------------------------------- 3. random traces


def random_trace(rng: random.Random, lifetime: float, outage: float, span: float) -> SpotTrace:
    """Spot lives an exponential `lifetime`; then half the time a preemption with capacity back at once,
    half the time an outage of exponential length `outage`."""
    t, preemptions, windows = rng.expovariate(1 / lifetime), [], []
    while t < span:
        if rng.random() < 0.5:
            preemptions.append(t)
            t += rng.expovariate(1 / lifetime)
        else:
            gone = rng.expovariate(1 / outage)
            windows.append((t, t + gone))
            t += gone + rng.expovariate(1 / lifetime)
    return SpotTrace(preemptions=preemptions, unavailable=windows)


def _random(results: Results, per_cell: int) -> str:
    lines = []
    for restart_h in (0.2, 1.0, 3.0):
        rng = random.Random(16)
        ratios: dict[str, list[float]] = {p: [] for p in dl.POLICIES}
        misses = 0
        for lifetime in (2 * HOUR, 6 * HOUR, 12 * HOUR):
            for outage in (0.5 * HOUR, 2 * HOUR, 6 * HOUR):
                for fraction in (0.6, 0.75, 0.9):
                    for _ in range(per_cell):
                        trace = random_trace(rng, lifetime, outage, 48 * HOUR / fraction * 1.5)
                        job = dl.Job(
                            steps=480,
                            step_seconds=360.0,
                            deadline=48 * HOUR / fraction,
                            restart_seconds=restart_h * HOUR,
                            spot_usd_per_hour=1.0,
                            on_demand_usd_per_hour=3.59,
                        )
                        od = dl.simulate(job, trace, dl.ALL_ON_DEMAND, tick=60, period=300).cost_usd
                        for policy in dl.POLICIES:
                            outcome = dl.simulate(job, trace, policy, tick=60, period=300)
                            ratios[policy].append(outcome.cost_usd / od)
                            misses += not outcome.met
        n = len(ratios[dl.DEFAULT_POLICY])
        cells = " | ".join(f"{statistics.fmean(ratios[p]):.3f}" for p in dl.POLICIES)
        lines.append(f"| {restart_h:g} h | {n} | {cells} | {misses} |")
        results.add(
            Figure(
                "deadline",
                f"random traces (sim), {restart_h:g} h changeover: {dl.DEFAULT_POLICY} / on-demand",
                "x",
                ratios[dl.DEFAULT_POLICY],
                goal="0 misses",
                met=misses == 0,
                note="mean: " + ", ".join(f"{p} {statistics.fmean(ratios[p]):.3f}" for p in dl.POLICIES),
            )
        )
    header = (
        "| changeover d | traces | "
        + " | ".join(f"{p} / on-demand (mean)" for p in dl.POLICIES)
        + " | misses |\n|---|---|"
        + "---|" * (len(dl.POLICIES) + 1)
        + "\n"
    )
    return header + "\n".join(lines)


# --------------------------------------------------------------------------- the report


def _section(sections: list[str], quick: bool) -> Section:
    """Section 8 of docs/benchmarks.md, between its markers; bench/__main__.py writes it (not with --no-write)."""
    m = machine()
    paper = "\n".join(f"| {w} | {t} | {lesson} |" for w, t, lesson in PAPER)
    block = (
        f"{START}\n\nLatest: `python -m bench --only deadline{' --quick' if quick else ''}`, {m['date']}, "
        f"{m['cores']} cores, {m['cpu']}.\n\n**1. Shipped traces on the local executor** (`tiny`, 300 steps, "
        f"deadline 260 s, policy `{dl.DEFAULT_POLICY}`; prices: g5.48xlarge in us-east-1 as the local run "
        f"stands for it):\n\n{sections[0]}\n\n**2. The same traces stretched 600x in the simulator** "
        f"(Can't Be Late's setting: 48 h of work, 0.2 h changeover; cost / all on-demand):\n\n{sections[1]}\n\n"
        f"**3. Random traces in the simulator** (cost / all on-demand, mean):\n\n{sections[2]}\n\n"
        f"**Can't Be Late's figures** (Table 5, real workloads on SkyPilot, Uniform Progress vs on-demand; "
        f"section 7.2: ML training with the loose deadline, greedy -15 %, Uniform Progress -48 %, "
        f"Omniscient -55 %):\n\n| workload | tight deadline (0.9) | loose (0.75) |\n|---|---|---|\n{paper}\n\n{END}"
    )
    return Section(START, END, block)
