"""`python -m bench --only X` rewrites X's rows of docs/benchmarks.md and keeps every other benchmark's rows."""

from __future__ import annotations

from bench import __main__ as bench_main
from bench.common import Figure, Results

PREVIOUS = f"""# Benchmarks

text above

{bench_main.RESULTS_START}

## Latest run

- command: `python -m bench` (12.0 min)
- date: 2026-11-29 13:33 UTC

| bench | figure | min | median | max | n | goal | met | note |
|---|---|---|---|---|---|---|---|---|
| cli | skyspot --help (s) | 0.24 | 0.264 | 0.322 | 7 | <= 0.3 s | yes | old |
| checkpoint | stall (s) | 0.02 | 0.03 | 0.04 | 5 |  |  | kept |
| overhead | skyspot / bare (x) | 0.9 | 0.95 | 0.97 | 2 | >= 0.97 | NO | kept too |
"""


def test_only_replaces_the_rows_it_ran_and_keeps_the_rest(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(PREVIOUS)
    monkeypatch.setattr(bench_main, "DOC", doc)
    results = Results()
    results.add(Figure("cli", "skyspot --help", "s", [0.1, 0.12, 0.11], goal="<= 0.3 s", met=True, note="new"))
    kept = bench_main.kept_rows(doc.read_text(), ["cli"])
    bench_main.write_doc(bench_main.render_report(results, "python -m bench --only cli", 60.0, kept))
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\ntext above\n")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| bench")]
    assert [r.split("|")[1].strip() for r in rows] == ["cli", "checkpoint", "overhead"]
    assert "| new |" in rows[0] and "old" not in text.split(bench_main.RESULTS_START)[1]
    assert "kept too" in rows[2]
    assert (
        "- kept from: `python -m bench` (12.0 min) (the rows of checkpoint, overhead, run 2026-11-29 13:33 UTC)" in text
    )
