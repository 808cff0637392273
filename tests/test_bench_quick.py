"""`python -m bench --quick` keeps its promise without hiding anything: every benchmark is either in the
quick run or named as left out of it, `--only NAME --quick` still runs a left-out one, `--no-write` writes
no file (not even the deadline section), and a misspelt name is a one-line usage error. No benchmark runs
here except `cli` (the cheapest) in the one subprocess test."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from bench import __main__ as bench_main
from bench.common import Figure, Section
from tests.trainer.launch import REPO

SECTION_START, SECTION_END = "<!-- fake results -->", "<!-- /fake results -->"
DOC_TEXT = f"""# Benchmarks

text above

{SECTION_START}
old section
{SECTION_END}

more text

{bench_main.RESULTS_START}

## Latest run

- command: `python -m bench` (12.0 min)
- date: 2026-11-29 13:33 UTC

| bench | figure | min | median | max | n | goal | met | note |
|---|---|---|---|---|---|---|---|---|
| hang | kept row (s) | 1 | 1 | 1 | 1 |  |  | from before |
"""


@pytest.fixture
def fake_suites(tmp_path, monkeypatch):
    """Every suite replaced by a stand-in that records (suite, quick) and adds one figure and a doc section;
    DOC points at a copy in tmp_path."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC_TEXT)
    monkeypatch.setattr(bench_main, "DOC", doc)
    calls: list[tuple[str, bool]] = []

    def fake_module(suite: str):
        def run(results, quick):
            calls.append((suite, quick))
            results.add(Figure(suite, "fake figure", "s", [1.0]))
            results.sections.append(Section(SECTION_START, SECTION_END, f"{SECTION_START}\nnew {suite}\n{SECTION_END}"))

        return types.SimpleNamespace(run=run)

    monkeypatch.setattr(
        bench_main.importlib,
        "import_module",
        lambda name: fake_module(next(s for s, m in bench_main.MODULES.items() if m == name)),
    )
    return doc, calls


def test_every_suite_is_in_the_quick_run_or_named_as_left_out():
    assert set(bench_main.QUICK_LEFT_OUT) <= set(bench_main.SUITES)
    assert set(bench_main.SUITES) == set(bench_main.MODULES)
    assert all(reason.strip() for reason in bench_main.QUICK_LEFT_OUT.values())


def test_quick_runs_the_quick_set_and_names_each_left_out_suite(fake_suites, capsys):
    doc, calls = fake_suites
    assert bench_main.main(["--quick", "--no-write"]) == 0
    err = capsys.readouterr().err
    assert calls == [(s, True) for s in bench_main.SUITES if s not in bench_main.QUICK_LEFT_OUT]
    for suite in bench_main.QUICK_LEFT_OUT:
        assert f"{suite}: left out of --quick" in err and f"run `python -m bench --only {suite}`" in err
        assert f"== {suite}\n" not in err


def test_a_left_out_suite_is_named_in_the_report_and_its_old_rows_kept(fake_suites, monkeypatch, capsys):
    doc, calls = fake_suites
    monkeypatch.setattr(bench_main, "QUICK_LEFT_OUT", {"hang": "too slow for the test"})
    assert bench_main.main(["--quick"]) == 0
    assert "hang" not in [s for s, _ in calls]
    assert (
        "hang: left out of --quick (too slow for the test): run `python -m bench --only hang`"
        in capsys.readouterr().err
    )
    results = doc.read_text().split(bench_main.RESULTS_START)[1]
    assert "- hang: left out of --quick (too slow for the test): run `python -m bench --only hang`" in results
    assert "| hang | kept row (s) | 1 | 1 | 1 | 1 |  |  | from before |" in results


def test_only_with_quick_runs_a_left_out_suite(fake_suites, monkeypatch, capsys):
    doc, calls = fake_suites
    monkeypatch.setattr(bench_main, "QUICK_LEFT_OUT", {"hang": "too slow for the test"})
    assert bench_main.main(["--only", "hang", "--quick", "--no-write"]) == 0
    assert calls == [("hang", True)]
    assert "left out" not in capsys.readouterr().err


def test_no_write_leaves_the_doc_and_its_sections_alone(fake_suites):
    doc, _ = fake_suites
    before = doc.stat().st_mtime_ns
    assert bench_main.main(["--quick", "--no-write"]) == 0
    assert doc.read_text() == DOC_TEXT and doc.stat().st_mtime_ns == before


def test_without_no_write_the_sections_and_the_results_are_written(fake_suites):
    doc, _ = fake_suites
    assert bench_main.main(["--only", "cli,upload"]) == 0
    text = doc.read_text()
    assert f"{SECTION_START}\nnew upload\n{SECTION_END}\n\nmore text" in text and "old section" not in text
    assert "- command: `python -m bench --only cli,upload`" in text


def test_the_deadline_benchmark_hands_its_section_over_instead_of_writing_the_doc(monkeypatch):
    from bench import deadline
    from bench.common import Results

    monkeypatch.setattr(deadline, "_local", lambda results, traces: "local table")
    monkeypatch.setattr(deadline, "_stretched", lambda results: "stretched table")
    monkeypatch.setattr(deadline, "_random", lambda results, per_cell: "random table")
    doc = REPO / "docs" / "benchmarks.md"
    before = (doc.read_bytes(), doc.stat().st_mtime_ns)
    results = Results()
    deadline.run(results, quick=True)
    assert (doc.read_bytes(), doc.stat().st_mtime_ns) == before
    (section,) = results.sections
    assert section.block.startswith(deadline.START) and section.block.endswith(deadline.END)
    assert "local table" in section.block and "--only deadline --quick" in section.block


@pytest.mark.slow  # a real benchmark run (about 15 s)
def test_a_real_quick_cli_run_with_no_write_changes_no_doc(tmp_path):
    docs = sorted((REPO / "docs").glob("*.md"))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in docs}
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "cli", "--quick", "--no-write"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| cli | skyspot --help (s) |" in done.stdout and "== cli" in done.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in docs} == before


def test_an_unknown_benchmark_is_a_one_line_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "cli,hangg", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"python -m bench: unknown benchmark(s): hangg; choose from: {', '.join(bench_main.SUITES)}"
    ]
