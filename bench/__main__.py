"""Run the benchmark suite and write docs/benchmarks.md.

python -m bench            # everything (the full run is unchanged by --quick's cuts)
python -m bench --quick    # five of the eleven, shorter runs, fewer repeats, smaller states: 2 min 44 s on 2
                           # idle cores, 6.6 min at load 7-9 (docs/benchmarks.md, Quick mode)
python -m bench --only deadline --quick   # a benchmark --quick leaves out, in its quick form
python -m bench --only cli,upload
python -m bench --gpu [--out DIR]   # the GPU check (bench/gpu.py; scripts/gpu_check.sh installs first)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from bench.common import Results, Section, machine

SUITES = [
    "cli",
    "upload",
    "checkpoint",
    "emergency",
    "recovery",
    "lost_work",
    "overhead",
    "deadline",
    "hang",
    "inplace",
    "bounds",
    "placement",
    "start",
]
MODULES = {
    "cli": "bench.cli_latency",
    "upload": "bench.upload",
    "checkpoint": "bench.checkpoint",
    "emergency": "bench.emergency",
    "recovery": "bench.recovery",
    "lost_work": "bench.lost_work",
    "overhead": "bench.overhead",
    "deadline": "bench.deadline",
    "hang": "bench.hang",
    "inplace": "bench.inplace",
    "bounds": "bench.bounds",
    "placement": "bench.placement",
    "start": "bench.start",
}
# What `--quick` leaves out, and why: each named here is reported as left out (stderr and the report's notes),
# never dropped silently; `--only NAME --quick` still runs it.
QUICK_LEFT_OUT: dict[str, str] = {
    "start": "six fresh interpreters importing torch and DeepSpeed, and a start of tiny: about 1.5 min",
    "lost_work": "four launches on the local executor, each through a notice window and a recovery: 2-4 min alone",
    "deadline": "its local replays run each trace to a 260 s deadline",
    "inplace": "two 2-node launches on the local executor, a crash and a recovery in each: 2-3 min alone",
    "emergency": "two trainers streaming 0.31 GB to an S3 server, then three uploads for the CPU figures: 1.5-2 min",
    "overhead": "two trainers of 60 steps side by side: 1.5 min, and one pair's ratio moves by 15 % under load",
    "bounds": "writes a run of thousands of attempts and reads it through the CLI: 1-2 min under load",
}
QUICK_MINUTES = "2 min 44 s measured on 2 idle cores, 6.6 min at load 7-9"
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
RESULTS_START = "<!-- results: written by `python -m bench`; edit the text above, not below -->"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"shorter runs, fewer repeats, smaller states: {QUICK_MINUTES}"
    )
    parser.add_argument(
        "--only",
        help=f"comma-separated subset of: {', '.join(SUITES)} (with --quick: runs these "
        "even if --quick leaves them out)",
    )
    parser.add_argument(
        "--no-write",
        action="store_true",
        help="print the table; write no file (docs/benchmarks.md and its deadline section stay as they are)",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU check instead (bench/gpu.py): writes DIR/gpu_check.json and .md, not the doc",
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="--gpu: where its figures go (%(default)s)")
    args = parser.parse_args(argv)
    if args.gpu:
        from bench.gpu import main as gpu_check

        return gpu_check(args.out)
    chosen = [c.strip() for c in args.only.split(",")] if args.only else list(SUITES)
    unknown = [c for c in chosen if c not in MODULES]
    if unknown:
        print(
            f"python -m bench: unknown benchmark(s): {', '.join(unknown)}; choose from: {', '.join(SUITES)}",
            file=sys.stderr,
        )
        return 2
    results = Results()
    left_out = [s for s in chosen if s in QUICK_LEFT_OUT] if args.quick and not args.only else []
    for suite in left_out:
        line = f"{suite}: left out of --quick ({QUICK_LEFT_OUT[suite]}): run `python -m bench --only {suite}`"
        print(line, file=sys.stderr, flush=True)
        results.notes.append(line)
    chosen = [s for s in chosen if s not in left_out]
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
    print(f"== total {time.time() - started:.0f}s", file=sys.stderr, flush=True)
    table = render_table(results)
    command = "python -m bench" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    if not args.no_write:
        partial = bool(args.only or left_out)
        kept = kept_rows(DOC.read_text() if DOC.exists() else "", chosen) if partial else []
        write_doc(render_report(results, command, time.time() - started, kept), results.sections)
    print(table)
    return 0


def kept_rows(doc: str, chosen: list[str]) -> list[str]:
    """With --only: the last report's rows of the benchmarks not run now, kept as they were."""
    if RESULTS_START not in doc:
        return []
    previous = doc.split(RESULTS_START, 1)[1]
    rows = [line for line in previous.splitlines() if line.startswith("| ") and not line.startswith("| bench |")]
    return [row for row in rows if row.split("|")[1].strip() in SUITES and row.split("|")[1].strip() not in chosen]


def _previous_commands(doc: str) -> list[str]:
    if RESULTS_START not in doc:
        return []
    previous = doc.split(RESULTS_START, 1)[1]
    return [line[2:] for line in previous.splitlines() if line.startswith(("- command:", "- kept from:"))]


def render_table(results: Results) -> str:
    header = "| bench | figure | min | median | max | n | goal | met | note |\n|---|---|---|---|---|---|---|---|---|\n"
    lines = []
    for f in results.figures:
        r = f.row()
        lines.append(
            f"| {r['bench']} | {r['name']} ({r['unit']}) | {_fmt(r['min'])} | {_fmt(r['median'])} | "
            f"{_fmt(r['max'])} | {r['n']} | {r['goal']} | {r['met']} | {r['note']} |"
        )
    return header + "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def render_report(results: Results, command: str, seconds: float, kept: list[str] = ()) -> str:
    m = machine()
    notes = "".join(f"- {n}\n" for n in results.notes)
    table = render_table(results)
    origin = ""
    if kept:
        # Rows of benchmarks this run left out stay, in suite order, and the report says where they came from.
        order = {suite: i for i, suite in enumerate(SUITES)}
        lines = table.splitlines()
        rows = sorted(lines[2:] + list(kept), key=lambda row: order.get(row.split("|")[1].strip(), len(SUITES)))
        table = "\n".join(lines[:2] + rows)
        earlier = [c.split(":", 1)[1].strip() for c in _previous_commands(DOC.read_text() if DOC.exists() else "")]
        suites = ", ".join(sorted({r.split("|")[1].strip() for r in kept}, key=lambda b: order.get(b, 0)))
        dates = [
            line[len("- date: ") :]
            for line in (DOC.read_text() if DOC.exists() else "").split(RESULTS_START)[-1].splitlines()
            if line.startswith("- date: ")
        ]
        when = f", run {dates[0]}" if dates else ""
        origin = f"- kept from: {'; '.join(earlier) or 'the previous report'} (the rows of {suites}{when})\n"
    return (
        f"{RESULTS_START}\n\n## Latest run\n\n- command: `{command}` ({seconds / 60:.1f} min, {m['date']})\n"
        f"{origin}"
        f"- machine: {m['cores']} cores, {m['memory']} memory, {m['disk_free']} disk free, {m['cpu']}, "
        f"Python {m['python']}\n- date: {m['date']}\n\n{table}\n\n{notes}"
    )


def write_doc(report: str, sections: list[Section] = ()) -> None:
    """The one writer of docs/benchmarks.md: the results below RESULTS_START, and each benchmark's own
    section (bench/deadline.py's) between its markers in the text above."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n\n"
    head = text.split(RESULTS_START)[0].rstrip() + "\n\n"
    for section in sections:
        if section.start in head and section.end in head:
            before, rest = head.split(section.start, 1)
            head = before + section.block + rest.split(section.end, 1)[1]
        else:
            print(f"{DOC.name} has no markers {section.start!r}; the section follows", file=sys.stderr)
            print(section.block, file=sys.stderr)
    DOC.write_text(head + report)


if __name__ == "__main__":
    sys.exit(main())
