"""Run the benchmark suite and write docs/benchmarks.md.

    python -m bench            # everything, about 15 minutes on 2 cores
    python -m bench --quick    # fewer repeats and smaller states, under 5 minutes
    python -m bench --only cli,upload
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from bench.common import Results, machine

SUITES = ["cli", "upload", "checkpoint", "recovery", "lost_work", "overhead"]
MODULES = {"cli": "bench.cli_latency", "upload": "bench.upload", "checkpoint": "bench.checkpoint",
           "recovery": "bench.recovery", "lost_work": "bench.lost_work", "overhead": "bench.overhead"}
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
RESULTS_START = "<!-- results: written by `python -m bench`; edit the text above, not below -->"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller states (< 5 min)")
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(SUITES)}")
    parser.add_argument("--no-write", action="store_true", help="print the table; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else SUITES
    unknown = [c for c in chosen if c not in MODULES]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    results = Results()
    started = time.time()
    for suite in chosen:
        try:
            module = importlib.import_module(MODULES[suite])
        except ModuleNotFoundError:
            results.notes.append(f"{suite}: not built yet")
            continue
        print(f"== {suite}", file=sys.stderr, flush=True)
        t0 = time.time()
        try:
            module.run(results, args.quick)
        except Exception as error:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            results.notes.append(f"{suite}: failed: {type(error).__name__}: {error}")
        print(f"   {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    table = render_table(results)
    command = "python -m bench" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    report = render_report(results, command, time.time() - started)
    if not args.no_write:
        write_doc(report)
    print(table)
    return 0


def render_table(results: Results) -> str:
    header = "| bench | figure | min | median | max | n | goal | met | note |\n|---|---|---|---|---|---|---|---|---|\n"
    lines = []
    for f in results.figures:
        r = f.row()
        lines.append(f"| {r['bench']} | {r['name']} ({r['unit']}) | {_fmt(r['min'])} | {_fmt(r['median'])} | "
                     f"{_fmt(r['max'])} | {r['n']} | {r['goal']} | {r['met']} | {r['note']} |")
    return header + "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def render_report(results: Results, command: str, seconds: float) -> str:
    m = machine()
    notes = "".join(f"- {n}\n" for n in results.notes)
    return (f"{RESULTS_START}\n\n## Latest run\n\n- command: `{command}` ({seconds / 60:.1f} min)\n"
            f"- machine: {m['cores']} cores, {m['memory']} memory, {m['disk_free']} disk free, {m['cpu']}, "
            f"Python {m['python']}\n- date: {m['date']}\n\n{render_table(results)}\n\n{notes}")


def write_doc(report: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n\n"
    head = text.split(RESULTS_START)[0].rstrip() + "\n\n"
    DOC.write_text(head + report)


if __name__ == "__main__":
    sys.exit(main())
