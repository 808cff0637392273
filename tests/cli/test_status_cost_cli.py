"""`status` and `cost-report` on runs built by hand (a ledger row plus event lines, no training):
their stable fields, and what they do with damaged event logs and a damaged ledger."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from skyspot.cli.cost import SUMMARY_FIELDS
from skyspot.cli.main import app
from skyspot.events import EVENTS_DIR, event_file_name
from skyspot.ledger import Ledger, skyspot_home
from tests.builders import event as _ev

runner = CliRunner()

T0 = 1_700_000_000.0
WHERE = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.48xlarge",
    "spot": True,
    "accelerators": None,
    "num_nodes": 1,
    "simulated": True,
}
STATUS_FIELDS = {"name", "recipe", "executor", "status", "recoveries", "step", "total_steps"}


def invoke(*args):
    result = runner.invoke(app, list(args), catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    return result


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code != 0 and result.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def preempted_once_events() -> dict[str, list[dict]]:
    """Attempt 0 runs steps 1-30 (checkpoint at 25) and is preempted; attempt 1 resumes at 25 and ends at 40."""
    trainer0 = [_ev(T0 + 5, "start", 0, where=WHERE, world_size=2, total_steps=40, recipe="tiny", pid=1)]
    trainer0 += [_ev(T0 + 5 + 10 * k, "step", 0, step=k, loss=2.0 - k / 100, step_seconds=10.0) for k in range(1, 31)]
    trainer0 += [
        _ev(T0 + 256, "checkpoint_end", 0, step=25, kind="interval", blocked_seconds=1.0),
        _ev(T0 + 310, "exit", 0, code=75, reason="preempted", step=30),
    ]
    executor0 = [
        _ev(T0, "attempt_start", 0, rank=None, where=WHERE),
        _ev(T0 + 306, "preempt_notice_sent", 0, rank=None, deadline=T0 + 336),
        _ev(T0 + 320, "attempt_end", 0, rank=None, code=75, reason="preempted"),
    ]
    trainer1 = [
        _ev(T0 + 405, "start", 1, where=WHERE, world_size=2, total_steps=40, recipe="tiny", pid=2),
        _ev(T0 + 410, "resume", 1, step=25, checkpoint="step_25", source="local", load_seconds=2.0),
    ]
    trainer1 += [_ev(T0 + 410 + 10 * (k - 25), "step", 1, step=k, loss=1.7, step_seconds=10.0) for k in range(26, 41)]
    trainer1 += [
        _ev(T0 + 562, "checkpoint_end", 1, step=40, kind="final", blocked_seconds=1.5),
        _ev(T0 + 565, "exit", 1, code=0, reason="complete", step=40),
    ]
    executor1 = [
        _ev(T0 + 400, "attempt_start", 1, rank=None, where=WHERE),
        _ev(T0 + 570, "attempt_end", 1, rank=None, code=0, reason="complete"),
    ]
    return {
        event_file_name(0, 0, 0): trainer0,
        event_file_name(0, 0, None): executor0,
        event_file_name(1, 0, 0): trainer1,
        event_file_name(1, 0, None): executor1,
    }


def write_events(run_dir: Path, files: dict[str, list[dict]], junk: dict[str, list[bytes]] | None = None) -> None:
    events = run_dir / EVENTS_DIR
    events.mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
        data = b"".join(json.dumps(e).encode() + b"\n" for e in lines)
        data += b"".join(line + b"\n" for line in (junk or {}).get(name, []))
        (events / name).write_bytes(data)


def make_run(name: str = "run-1", status: str = "SUCCEEDED", files=None, info=None) -> Path:
    run_dir = skyspot_home() / "runs" / name
    write_events(run_dir, preempted_once_events() if files is None else files)
    ledger = Ledger()
    try:
        ledger.add(
            name,
            "tiny",
            "local",
            run_dir=str(run_dir),
            total_steps=40,
            num_nodes=1,
            info={"cloud": "aws"} if info is None else info,
        )
        ledger.set_status(name, status)
    finally:
        ledger.close()
    return run_dir


def status_rows(*extra) -> list[dict]:
    result = invoke("status", "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- stable fields


def test_status_json_shows_a_hand_built_run():
    make_run()
    rows = status_rows()
    assert len(rows) == 1
    row = rows[0]
    assert STATUS_FIELDS <= set(row)
    assert {k: row[k] for k in STATUS_FIELDS} == {
        "name": "run-1",
        "recipe": "tiny",
        "executor": "local",
        "status": "SUCCEEDED",
        "recoveries": 1,
        "step": 40,
        "total_steps": 40,
    }
    assert row["cloud"] == "aws" and row["spot"] is True and row["simulated"] is True
    assert row["last_checkpoint"] == 40 and row["malformed_event_lines"] == 0
    assert row["cost_so_far_usd"] > 0


def test_cost_report_json_and_csv_have_stable_fields():
    make_run()
    rows = json.loads(invoke("cost-report", "--json").stdout)
    assert len(rows) == 1 and list(rows[0]) == SUMMARY_FIELDS
    row = rows[0]
    assert (row["name"], row["recipe"], row["executor"], row["status"]) == ("run-1", "tiny", "local", "SUCCEEDED")
    assert row["preemptions"] == 1 and row["recoveries"] == 1
    assert row["lost_steps"] == 5 and row["lost_seconds"] == pytest.approx(50.0)  # steps 26-30 ran twice
    assert row["checkpoint_overhead_seconds"] == pytest.approx(2.5)
    assert row["simulated"] is True and row["estimated"] is True and row["cost_usd"] > 0

    table = list(csv.reader(io.StringIO(invoke("cost-report", "--csv").stdout)))
    assert table[0] == SUMMARY_FIELDS and len(table) == 2 and table[1][0] == "run-1"

    one = json.loads(invoke("cost-report", "run-1", "--json").stdout)[0]
    assert [a["attempt"] for a in one["attempts"]] == [0, 1]
    assert [a["end_reason"] for a in one["attempts"]] == ["preempted", "complete"]
    attempts = list(csv.DictReader(io.StringIO(invoke("cost-report", "run-1", "--csv").stdout)))
    assert [a["attempt"] for a in attempts] == ["0", "1"] and attempts[0]["instance_type"] == "g5.48xlarge"


def test_a_plot_that_cannot_be_written_is_one_line(tmp_path):
    make_run()
    (tmp_path / "a-file").write_text("x")
    line = one_line_error(invoke("cost-report", "run-1", "--plot", str(tmp_path / "a-file" / "plot.png")))
    assert "cannot write" in line


def test_logs_of_a_row_without_a_run_dir_is_one_line():
    make_run()
    _raw("UPDATE runs SET run_dir = NULL WHERE name = 'run-1'")
    assert "no local run directory" in one_line_error(invoke("logs", "run-1"))


def test_cost_report_table_of_one_run_reads_the_same_figures():
    make_run()
    result = invoke("cost-report", "run-1")
    assert result.exit_code == 0
    assert "preemptions 1" in result.stdout and "lost steps 5" in result.stdout


# --------------------------------------------------------------------------- damaged event logs

JUNK_LINES = [
    b'{"ts": 1700000001.0, "run_id": "run-1", "attempt": 0, "type": "st',  # truncated by a kill
    b"\x00\xff\xfe\x80garbage\x1b[31m",
    b'{"ts": "yesterday", "attempt": 0, "type": "step", "step": 3}',
    b'{"ts": null, "attempt": 0, "type": "step", "step": 3}',
    b'{"ts": NaN, "attempt": 0, "type": "step", "step": 3}',
    b'{"ts": Infinity, "attempt": 0, "type": "attempt_end"}',
    b'{"ts": true, "attempt": 0, "type": "step", "step": 3}',
    b'{"ts": 1700000001.0, "attempt": "zero", "type": "step", "step": 3}',
    b'{"ts": 1700000001.0, "attempt": -1, "type": "step", "step": 3}',
    b'{"ts": 1700000001.0, "attempt": 1.5, "type": "step", "step": 3}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "step", "step": "three"}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "step", "step": null}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "step", "step": 3.5, "step_seconds": 1}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "step", "step": 3, "step_seconds": "slow"}',
    b'{"ts": 1700000001.0, "attempt": 0, "rank": "0", "type": "step", "step": 3}',
    b'{"ts": 1700000001.0, "attempt": 0, "node_rank": [0], "type": "start"}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "attempt_start", "where": "aws"}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "attempt_start", "where": {"num_nodes": "two"}}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "attempt_start", "where": {"accelerators": "H100:x"}}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "checkpoint_end", "step": 5, "blocked_seconds": [1]}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": "resume", "step": 5, "load_seconds": "fast"}',
    b'{"ts": 1700000001.0, "attempt": 0, "type": 7}',
    b'["ts", 1700000001.0]',
    b"1700000001.0",
    b'"just a string"',
    b"[" * 5000,
    b"{" + b'"a":' * 3000 + b"1" + b"}" * 3000,
]


def test_malformed_event_lines_are_skipped_counted_and_change_no_figure():
    make_run("clean")
    files = preempted_once_events()
    junk = {name: JUNK_LINES[i :: len(files)] for i, name in enumerate(files)}
    write_events(make_run("damaged", files=files), files, junk)

    result = invoke("status", "--json")
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["damaged"]["malformed_event_lines"] == len(JUNK_LINES)
    assert f"skipped {len(JUNK_LINES)} malformed event line(s)" in result.stderr
    ignore = {"name", "malformed_event_lines", "elapsed_seconds", "cost_so_far_usd"}
    assert {k: v for k, v in rows["damaged"].items() if k not in ignore} == {
        k: v for k, v in rows["clean"].items() if k not in ignore
    }
    assert rows["damaged"]["cost_so_far_usd"] == pytest.approx(rows["clean"]["cost_so_far_usd"])

    table = invoke("status")
    assert table.exit_code == 0 and "damaged" in table.stdout and "malformed" in table.stderr

    result = invoke("cost-report", "--json")
    assert result.exit_code == 0 and f"skipped {len(JUNK_LINES)} malformed event line(s)" in result.stderr
    reports = {r["name"]: r for r in json.loads(result.stdout)}
    assert {k: v for k, v in reports["damaged"].items() if k != "name"} == {
        k: v for k, v in reports["clean"].items() if k != "name"
    }
    one = invoke("cost-report", "damaged")
    assert one.exit_code == 0 and f"skipped {len(JUNK_LINES)} malformed event line(s)" in one.stderr


def _junk_line():
    valid = json.dumps(preempted_once_events()[event_file_name(0, 0, 0)][3]).encode()
    truncated = st.integers(1, len(valid) - 1).map(lambda n: valid[:n])
    binary = st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\x00junk")
    bad_value = st.one_of(
        st.text(max_size=5),
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True).filter(lambda f: f != f),
        st.lists(st.integers(), max_size=2),
        st.just(-1),
        st.just(1.5),
    )
    wrong_type = st.tuples(st.sampled_from(["ts", "attempt", "step"]), bad_value).map(
        lambda kv: json.dumps({**json.loads(valid), kv[0]: kv[1]}).encode()
    )
    return st.one_of(truncated, binary, wrong_type).filter(_is_invalid)


def _is_invalid(line: bytes) -> bool:
    # A wrong "type" that still is the right one (e.g. attempt 0 drawn for attempt) is not junk.
    from skyspot.events import valid_event

    try:
        return not valid_event(json.loads(line.decode("utf-8", "replace")))
    except ValueError:
        return True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.lists(st.tuples(st.integers(0, 3), _junk_line()), min_size=1, max_size=6))
def test_any_junk_in_event_files_is_skipped_and_counted(tmp_path, monkeypatch, junk):
    monkeypatch.setenv("SKYSPOT_HOME", str(tmp_path / f"home-{len(list(tmp_path.iterdir()))}"))
    files = preempted_once_events()
    names = sorted(files)
    by_file: dict[str, list[bytes]] = {}
    for index, line in junk:
        by_file.setdefault(names[index], []).append(line)
    make_run("r", files=files)
    write_events(skyspot_home() / "runs" / "r", files, by_file)
    row = status_rows()[0]
    assert row["malformed_event_lines"] == len(junk)
    assert (row["step"], row["recoveries"], row["last_checkpoint"]) == (40, 1, 40)
    report = invoke("cost-report", "--json")
    assert report.exit_code == 0 and f"skipped {len(junk)} malformed event line(s)" in report.stderr
    assert json.loads(report.stdout)[0]["lost_steps"] == 5


def test_unreadable_and_odd_event_files_do_not_crash(tmp_path):
    run_dir = make_run()
    (run_dir / EVENTS_DIR / "attempt-9.node-0.rank-0.jsonl").mkdir()  # a directory where a file should be
    (run_dir / EVENTS_DIR / "attempt-8.executor.jsonl").write_bytes(b"\xff" * 100)
    rows = status_rows()
    assert rows[0]["step"] == 40 and rows[0]["malformed_event_lines"] == 2
    assert invoke("cost-report", "--json").exit_code == 0


def test_a_run_whose_events_are_gone_still_lists():
    run_dir = make_run()
    for path in (run_dir / EVENTS_DIR).iterdir():
        path.unlink()
    (run_dir / EVENTS_DIR).rmdir()
    row = status_rows()[0]
    assert row["name"] == "run-1" and row["step"] == 0 and row["cost_so_far_usd"] == 0.0
    for args in (["cost-report", "--json"], ["cost-report"], ["cost-report", "run-1"], ["status"]):
        result = invoke(*args)
        assert result.exit_code == 0 and "run-1" in result.stdout + result.stderr, result.stderr


# --------------------------------------------------------------------------- damaged ledger


@pytest.mark.parametrize(
    "content", [b"this is not a database\n" * 50, b"\x00" * 8192, b"SQLite format 3\x00" + b"\xff" * 4000]
)
def test_a_garbage_ledger_is_one_line_telling_to_move_it_aside(content):
    (skyspot_home() / "ledger.db").write_bytes(content)
    for args in (["status"], ["status", "--json"], ["cost-report"], ["cost-report", "--csv"], ["cost-report", "x"]):
        line = one_line_error(invoke(*args))
        assert "ledger" in line and "damaged" in line and "move it aside" in line


def test_a_truncated_ledger_is_one_line_telling_to_move_it_aside():
    for i in range(4):
        make_run(f"run-{i}", files={})
    path = skyspot_home() / "ledger.db"
    ledger = Ledger()
    ledger._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    ledger.close()
    data = path.read_bytes()
    assert len(data) > 4096
    path.write_bytes(data[:4096])  # page 1 (header, schema) survives, the table's pages do not
    for args in (["status", "-a"], ["cost-report"], ["cost-report", "run-3"]):
        assert "move it aside" in one_line_error(invoke(*args))


def test_skyspot_home_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    home = tmp_path / "home-file"
    home.write_text("x")
    monkeypatch.setenv("SKYSPOT_HOME", str(home))
    assert "SKYSPOT_HOME" in one_line_error(invoke("status"))


def _raw(sql: str, *params) -> None:
    db = sqlite3.connect(skyspot_home() / "ledger.db")
    db.execute(sql, params)
    db.commit()
    db.close()


@pytest.mark.parametrize(
    "info",
    ["{not json", "[1, 2]", '"a string"', "null", "", '{"candidates": "junk"}', '{"candidates": [1, "x", null]}'],
)
def test_a_row_with_bad_info_still_shows_and_reports(info):
    make_run()
    _raw("UPDATE runs SET info = ? WHERE name = 'run-1'", info)
    row = status_rows()[0]
    assert row["name"] == "run-1" and row["step"] == 40
    for args in (["cost-report", "--json"], ["cost-report", "run-1", "--json"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)[0]["preemptions"] == 1


@pytest.mark.parametrize(
    "column, value",
    [
        ("created_at", "yesterday"),
        ("total_steps", "forty"),
        ("ended_at", "x"),
        ("run_dir", b"\xff\x00"),
        ("created_at", None),
        ("job_id", 1.5),
        ("created_at", float("inf")),
        ("name", b"bad"),
    ],
)
def test_a_row_with_wrong_types_is_skipped_and_reported(column, value):
    make_run("good")
    make_run("bad")
    if value is None:
        _set_null_created("bad")
    else:
        _raw(f"UPDATE runs SET {column} = ? WHERE name = 'bad'", value)
    result = invoke("status", "--json", "-a")
    assert result.exit_code == 0, result.stderr
    assert [r["name"] for r in json.loads(result.stdout)] == ["good"]
    assert "skipped 1 damaged ledger row(s)" in result.stderr
    result = invoke("cost-report", "--json")
    assert result.exit_code == 0 and [r["name"] for r in json.loads(result.stdout)] == ["good"]
    assert "skipped 1 damaged ledger row(s)" in result.stderr
    if column != "name":
        assert "damaged" in one_line_error(invoke("cost-report", "bad"))


def _set_null_created(name: str) -> None:
    # created_at is NOT NULL in the schema: a damaged copy without the constraint is what holds a NULL.
    db = sqlite3.connect(skyspot_home() / "ledger.db")
    db.executescript("""
        PRAGMA writable_schema = ON;
        UPDATE sqlite_master SET sql = replace(sql, 'created_at REAL NOT NULL', 'created_at REAL') WHERE name = 'runs';
        PRAGMA writable_schema = OFF;
    """)
    db.close()
    db = sqlite3.connect(skyspot_home() / "ledger.db")
    db.execute("UPDATE runs SET created_at = NULL WHERE name = ?", (name,))
    db.commit()
    db.close()


def test_status_and_cost_report_of_an_empty_ledger():
    result = invoke("status", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == []
    result = invoke("cost-report", "--csv")
    assert result.exit_code == 0 and result.stdout.splitlines() == [",".join(SUMMARY_FIELDS)]
    assert "no run named 'nope'" in one_line_error(invoke("cost-report", "nope"))


# --------------------------------------------------------------------------- egress

GCP_WHERE = {
    **WHERE,
    "cloud": "gcp",
    "region": "us-central1",
    "zone": "us-central1-a",
    "instance_type": "g2-standard-96",
    "accelerators": "L4:8",
}
TEN_GIB = 10 * 2**30


def store_traffic_events() -> dict[str, list[dict]]:
    """The preempted-once run on GCP, with a checkpoint upload in each attempt and attempt 1 resuming
    from the store (10 GiB up each time, 10 GB down)."""
    files = {}
    for name, events in preempted_once_events().items():
        events = [dict(e, where=GCP_WHERE) if "where" in e else e for e in events]
        events = [dict(e, source="store", bytes=10**10) if e["type"] == "resume" else e for e in events]
        files[name] = events
    files[event_file_name(0, 0, 0)].append(
        _ev(T0 + 300, "upload_end", 0, step=25, bytes=TEN_GIB, seconds=40.0, durable=True, error=None, node=0, nodes=1)
    )
    files[event_file_name(1, 0, 0)].append(
        _ev(T0 + 566, "upload_end", 1, step=40, bytes=TEN_GIB, seconds=40.0, durable=True, error=None, node=0, nodes=1)
    )
    return files


def make_store_run(name: str, store: str) -> None:
    run_dir = skyspot_home() / "runs" / name
    write_events(run_dir, store_traffic_events())
    ledger = Ledger()
    try:
        ledger.add(name, "tiny", "local", run_dir=str(run_dir), store=store, total_steps=40, num_nodes=1, info={})
        ledger.set_status(name, "SUCCEEDED")
    finally:
        ledger.close()


def test_cost_report_counts_egress_for_a_cross_cloud_attempt_and_none_on_the_store_cloud():
    make_store_run("cross", "s3://my-bucket/runs")  # GPUs on GCP, store on S3
    make_store_run("same", "gs://my-bucket/runs")  # GPUs and store on GCP
    rows = {r["name"]: r for r in json.loads(invoke("cost-report", "--json").stdout)}
    # Two uploads out of GCP: 2 x 10 GiB x $0.12/GiB = $2.40; one resume out of AWS: 10 GB x $0.09 = $0.90.
    assert rows["cross"]["egress_usd"] == pytest.approx(3.30)
    assert rows["cross"]["egress_bytes"] == 2 * TEN_GIB + 10**10
    assert (rows["same"]["egress_usd"], rows["same"]["egress_bytes"]) == (0, 0)
    assert rows["cross"]["cost_usd"] == pytest.approx(rows["same"]["cost_usd"] + 3.30)

    summary = list(csv.DictReader(io.StringIO(invoke("cost-report", "--csv").stdout)))
    assert {r["name"]: float(r["egress_usd"]) for r in summary} == pytest.approx({"cross": 3.30, "same": 0.0})
    attempts = list(csv.DictReader(io.StringIO(invoke("cost-report", "cross", "--csv").stdout)))
    assert [(a["egress_upload_bytes"], a["egress_download_bytes"]) for a in attempts] == [
        (str(TEN_GIB), "0"),
        (str(TEN_GIB), str(10**10)),
    ]
    assert [float(a["egress_usd"]) for a in attempts] == pytest.approx([1.20, 2.10])
    assert [float(a["cost_usd"]) for a in attempts] == pytest.approx(
        [float(a["compute_usd"]) + float(a["egress_usd"]) for a in attempts]
    )

    table = invoke("cost-report", "cross").stdout
    assert "EGRESS" in table and "$1.2000" in table and "$2.1000" in table
    assert "(egress $3.30, store on aws)" in table
    assert "EGRESS" in invoke("cost-report").stdout


# --------------------------------------------------------------------------- the first hour (issue 18)


def test_money_puts_the_minus_sign_before_the_dollar():
    from skyspot.cli.common import usd

    assert usd(-0.0912) == "-$0.0912"
    assert usd(-0.0912, 2) == "-$0.09"
    assert usd(-1234.5) == "-$1,234.50"
    assert usd(0.0668) == "$0.0668" and usd(12.3) == "$12.30"
    assert usd(-0.001, 2) == "$0.00"  # no "-$0.00"
    assert usd(None) == "-" and usd(float("nan")) == "-"


def costly_recovery_events() -> dict[str, list[dict]]:
    """Attempt 0 runs steps 1-30 and is killed with no checkpoint; attempt 1 takes 1000 s to start,
    then runs all 40 steps: the recovery costs more than the spot discount saves."""
    trainer0 = [_ev(T0 + 5, "start", 0, where=WHERE)]
    trainer0 += [_ev(T0 + 5 + 10 * k, "step", 0, step=k, step_seconds=10.0) for k in range(1, 31)]
    executor0 = [
        _ev(T0, "attempt_start", 0, rank=None, where=WHERE),
        _ev(T0 + 310, "attempt_end", 0, rank=None, code=-9, reason="preempted"),
    ]
    trainer1 = [_ev(T0 + 1400, "start", 1, where=WHERE)]
    trainer1 += [_ev(T0 + 1400 + 10 * k, "step", 1, step=k, step_seconds=10.0) for k in range(1, 41)]
    trainer1 += [_ev(T0 + 1805, "exit", 1, code=0, reason="complete", step=40)]
    executor1 = [
        _ev(T0 + 400, "attempt_start", 1, rank=None, where=WHERE),
        _ev(T0 + 1810, "attempt_end", 1, rank=None, code=0, reason="complete"),
    ]
    return {
        event_file_name(0, 0, 0): trainer0,
        event_file_name(0, 0, None): executor0,
        event_file_name(1, 0, 0): trainer1,
        event_file_name(1, 0, None): executor1,
    }


def test_a_loss_reads_minus_dollars_and_says_why():
    make_run("costly", files=costly_recovery_events())
    report = json.loads(invoke("cost-report", "costly", "--json").stdout)[0]
    assert report["savings_usd"] < 0
    table = invoke("cost-report").stdout
    assert "-$" in table and "$-" not in table
    one = invoke("cost-report", "costly")
    assert one.exit_code == 0
    text = " ".join(one.stdout.split())
    assert "saved -$" in text and "$-" not in text
    assert "spot cost more here" in text


def test_cost_report_states_the_baseline_it_used():
    make_run()
    report = json.loads(invoke("cost-report", "run-1", "--json").stdout)[0]
    # One start-up (attempt start T0 -> step 1 starts T0+5), 40 useful steps, one wind-down (step 40
    # ends T0+560 -> attempt end T0+570).
    assert (report["startup_seconds"], report["useful_seconds"], report["wind_down_seconds"]) == (5, 400, 10)
    assert report["baseline_seconds"] == 415
    assert report["on_demand_cost_usd"] == pytest.approx(415 / 3600 * report["baseline_usd_per_hour"])
    text = " ".join(invoke("cost-report", "run-1").stdout.split())
    assert (
        "on-demand baseline $1.88: this run as one uninterrupted attempt on aws g5.48xlarge us-east-1 on "
        "demand at $16.29/h x 1 node: start-up 5.0s + 40 useful steps 400.0s + wind-down 10.0s = 415.0s"
    ) in text
    summary = " ".join(invoke("cost-report").stdout.split())
    assert "ON-DEMAND: the same run as one uninterrupted attempt on the cheapest on-demand candidate" in summary


RUN_NAMES = [f"tiny-20261130-1858{i:02d}-d9f{i % 10}" for i in range(12)]


def _a_dozen_runs():
    statuses = ["RUNNING", "RECOVERING", "CANCELLED", "SUCCEEDED", "FAILED", "CANCELLING"] * 2
    for name, status in zip(RUN_NAMES, statuses):
        make_run(name, status=status)


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_status_fits_the_terminal_with_a_dozen_runs(monkeypatch, columns):
    _a_dozen_runs()
    monkeypatch.setenv("COLUMNS", str(columns))
    result = invoke("status", "-a")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns, "\n" + result.stdout
    # Every run on one line of its own, its name and status whole (never "CANCELLE" / "D").
    for name in RUN_NAMES:
        [line] = [line for line in lines if name in line]
        assert line.split()[1] in ("RUNNING", "RECOVERING", "CANCELLED", "SUCCEEDED", "FAILED", "CANCELLING")
    header = lines[0].split()
    assert header[:2] == ["NAME", "STATUS"] and "EST. COST" in lines[0]
    if columns >= 100:
        assert "WHERE" in header and "#RECOVERIES" in header and "aws/us-east-1" in result.stdout
    assert "hidden to fit" in result.stderr and "--json" in result.stderr


def test_status_on_a_wide_page_shows_every_column(monkeypatch):
    _a_dozen_runs()
    monkeypatch.setenv("COLUMNS", "200")
    result = invoke("status", "-a")
    assert result.stdout.splitlines()[0].split() == [
        "NAME",
        "RECIPE",
        "EXECUTOR",
        "STATUS",
        "WHERE",
        "CAPACITY",
        "STEP",
        "#RECOVERIES",
        "LAST",
        "CKPT",
        "ELAPSED",
        "EST.",
        "COST",
    ]
    assert "hidden" not in result.stderr


@pytest.mark.parametrize("columns", [80, 120])
def test_cost_report_tables_fit_the_terminal(monkeypatch, columns):
    _a_dozen_runs()
    monkeypatch.setenv("COLUMNS", str(columns))
    for args in (["cost-report"], ["cost-report", RUN_NAMES[0]], ["prices"]):
        result = invoke(*args)
        assert result.exit_code == 0
        table_lines = [line for line in result.stdout.splitlines() if "  " in line]  # the tables' rows
        assert table_lines and max(len(line) for line in table_lines) <= columns, "\n" + result.stdout


def test_simulated_stays_simulated_once_the_trainer_has_started():
    # The trainer's `start` (written after the executor's attempt_start) carries no "simulated".
    files = preempted_once_events()
    for events in files.values():
        for event in events:
            if event["type"] == "start":
                event["where"] = {k: v for k, v in WHERE.items() if k != "simulated"}
    make_run(files=files, status="RUNNING")
    row = status_rows()[0]
    assert row["simulated"] is True
    assert json.loads(invoke("cost-report", "--json").stdout)[0]["simulated"] is True
    assert "(sim)" in invoke("status").stdout and "(sim)" in invoke("cost-report").stdout


def _with_log(name: str, status: str, text: str) -> None:
    run_dir = make_run(name, status=status)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "run.log").write_text(text)


def test_logs_and_cancel_take_the_newest_run_by_default():
    _with_log("older", "RUNNING", "older's log\n")
    _with_log("newer", "SUCCEEDED", "newer's log\n")
    result = invoke("logs")
    assert result.exit_code == 0
    assert result.stdout == "newer's log\n" and "logs of 'newer', the newest run" in result.stderr
    # cancel: the newest run that has not ended (here its controller is gone, so it is marked at once).
    result = invoke("cancel", "-y")
    assert result.exit_code == 0 and "run 'older' had no live controller; marked CANCELLED" in result.stderr
    assert {r["name"]: r["status"] for r in status_rows("-a")} == {"older": "CANCELLED", "newer": "SUCCEEDED"}
    assert "no running run to cancel" in one_line_error(invoke("cancel", "-y"))


def test_cancel_all_stops_every_run_that_has_not_ended():
    for name, status in (("a", "RUNNING"), ("b", "RECOVERING"), ("c", "SUCCEEDED")):
        make_run(name, status=status)
    result = invoke("cancel", "--all", "-y")
    assert result.exit_code == 0
    assert {r["name"]: r["status"] for r in status_rows("-a")} == {"a": "CANCELLED", "b": "CANCELLED", "c": "SUCCEEDED"}
    assert "every run has ended" in invoke("cancel", "--all", "-y").stderr
    assert "not both" in one_line_error(invoke("cancel", "a", "--all"))


def test_logs_with_no_runs_at_all_says_how_to_start_one():
    assert "`skyspot launch tiny --local` starts one" in one_line_error(invoke("logs"))


def test_status_loads_neither_pydantic_nor_rich():
    """docs/benchmarks.md, CLI latency: Typer's pydantic coercion and rich's table layout are off this path."""
    import subprocess
    import sys

    make_run()
    code = (
        "import sys; sys.argv = ['skyspot', 'status', '-a']\n"
        "from skyspot.cli.main import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('pydantic', 'typer._adapters', 'rich.console', 'rich.table') if m in sys.modules),"
        " file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "run-1" in done.stdout, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]"


def test_a_start_up_longer_than_the_training_is_named_beside_goodput():
    files = preempted_once_events()
    # Attempt 0's trainer starts 5 s in; push its steps 1000 s later, as a first op build would.
    for name, events in files.items():
        for event in events:
            if event["attempt"] == 0 and event["type"] in (
                "step",
                "checkpoint_end",
                "exit",
                "attempt_end",
                "preempt_notice_sent",
            ):
                event["ts"] += 1000
    make_run(files=files)
    text = " ".join(invoke("cost-report", "run-1").stdout.split())
    assert "goodput" in text and "(the first start-up alone took 1005.0s)" in text
    make_run("plain")
    assert "first start-up alone" not in " ".join(invoke("cost-report", "plain").stdout.split())


def test_status_says_why_a_run_failed():
    make_run("broken", status="FAILED", info={"cloud": "aws", "cause": "usage error: no AWS credentials found"})
    make_run("fine")
    assert {r["name"]: r["cause"] for r in status_rows("-a")} == {
        "broken": "usage error: no AWS credentials found",
        "fine": None,
    }
    result = invoke("status", "-a")
    assert "broken FAILED: usage error: no AWS credentials found" in result.stderr
    assert "fine" not in result.stderr


def interrupted_twice_events() -> dict[str, list[dict]]:
    """Shapes from a real run (`skyspot launch tiny --local --simulate aws --notice 1 --preempt-at-steps 20
    train.steps=200`): attempt 0 a simulated spot preemption (AWS instance-action `terminate`), attempt 1
    ended by a planned AWS `system-reboot` the trainer acted on, attempt 2 completes."""
    files = {}
    for attempt, (t, action, executor_notice) in enumerate(((0, "terminate", True), (100, "system-reboot", False))):
        trainer = [
            _ev(T0 + t + 5, "start", attempt, where=WHERE, world_size=2, total_steps=40, recipe="tiny", pid=1),
            _ev(
                T0 + t + 16.5,
                "preemption_notice",
                attempt,
                source="aws",
                deadline=T0 + t + 17,
                action=action,
                received=T0 + t + 16.48,
            ),
            _ev(T0 + t + 16.6, "emergency_checkpoint", attempt, step=10 * (attempt + 1), signal_to_commit_seconds=0.11),
            _ev(
                T0 + t + 16.6,
                "exit",
                attempt,
                code=75,
                step=10 * (attempt + 1),
                reason=f"preempted: emergency checkpoint step_{10 * (attempt + 1)} committed",
            ),
        ]
        executor = [
            _ev(T0 + t, "attempt_start", attempt, rank=None, where=WHERE),
            _ev(T0 + t + 18.5, "attempt_end", attempt, rank=None, code=75, reason="preempted", node_codes=[75]),
        ]
        if executor_notice:
            executor.insert(1, _ev(T0 + t + 16.3, "preempt_notice_sent", attempt, rank=None, deadline=T0 + t + 17.3))
        files[event_file_name(attempt, 0, 0)], files[event_file_name(attempt, 0, None)] = trainer, executor
    files[event_file_name(2, 0, 0)] = [
        _ev(T0 + 205, "start", 2, where=WHERE, world_size=2, total_steps=40, recipe="tiny", pid=3),
        _ev(T0 + 206, "resume", 2, step=20, checkpoint="step_20", source="local", load_seconds=0.2),
        _ev(T0 + 220, "exit", 2, code=0, reason="training complete", step=40),
    ]
    files[event_file_name(2, 0, None)] = [
        _ev(T0 + 200, "attempt_start", 2, rank=None, where=WHERE),
        _ev(T0 + 221, "attempt_end", 2, rank=None, code=0, reason="complete"),
    ]
    return files


def test_cost_report_names_what_interrupted_each_attempt_and_sums_them(monkeypatch):
    make_run(files=interrupted_twice_events())
    monkeypatch.setenv("COLUMNS", "200")
    text = invoke("cost-report", "run-1").stdout
    attempt_rows = [line for line in text.splitlines() if "aws/us-east-1" in line]  # the attempts table
    assert len(attempt_rows) == 3 and "spot-preemption (terminate)" in attempt_rows[0]
    assert "planned-maintenance (system-reboot)" in attempt_rows[1] and "-" in attempt_rows[2].split()
    recoveries = text[text.index("recoveries") :].splitlines()
    assert recoveries[2].split()[:2] == ["1", "spot-preemption"] and recoveries[3].split()[1] == "planned-maintenance"
    assert "interrupted by: 1 spot preemption, 1 planned maintenance" in text
    assert "1 spot preemption, 1 planned maintenance" in invoke("cost-report").stdout.splitlines()[2]

    (row,) = json.loads(invoke("cost-report", "--json").stdout)
    assert row["interruptions_by_cause"] == {"spot-preemption": 1, "planned-maintenance": 1}
    assert row["interruptions"] == "1 spot preemption, 1 planned maintenance"
    (summary,) = csv.DictReader(io.StringIO(invoke("cost-report", "--csv").stdout))
    assert summary["interruptions_by_cause"] == "spot-preemption=1;planned-maintenance=1"
    one = json.loads(invoke("cost-report", "run-1", "--json").stdout)[0]
    assert [(a["cause"], a["cloud_cause"]) for a in one["attempts"]] == [
        ("spot-preemption", "terminate"),
        ("planned-maintenance", "system-reboot"),
        (None, None),
    ]
    assert [r["interruption_cause"] for r in one["recovery_details"]] == ["spot-preemption", "planned-maintenance"]
    attempts = list(csv.DictReader(io.StringIO(invoke("cost-report", "run-1", "--csv").stdout)))
    assert [(a["cause"], a["cloud_cause"]) for a in attempts] == [
        ("spot-preemption", "terminate"),
        ("planned-maintenance", "system-reboot"),
        ("", ""),
    ]
    assert status_rows("-a")[0]["interruptions"] == {"spot-preemption": 1, "planned-maintenance": 1}


# --------------------------------------------------------------------------- evaluations and in-place restarts


def _restarted_run(name: str = "restarted") -> None:
    """tests/pricing/test_restarts_and_evals.py's run: two in-place restarts (a crash, a hang), a preemption,
    three evaluations, the last one loss 1.1 at step 16."""
    from tests.pricing.test_restarts_and_evals import restarted_run

    files: dict[str, list[dict]] = {}
    for e in restarted_run().events:
        files.setdefault(event_file_name(e["attempt"], e["node_rank"], e["rank"]), []).append(e)
    make_run(name, files=files)


def test_cost_report_json_has_the_final_eval_and_the_in_place_figures():
    _restarted_run()
    [row] = json.loads(invoke("cost-report", "--json").stdout)
    assert (row["final_eval_loss"], row["final_eval_step"], row["eval_seconds"]) == (1.1, 16, 5.5)
    assert (row["restarts_in_place"], row["hangs"], row["recoveries"]) == (2, 1, 1)
    assert row["mttr_in_place_seconds"] == pytest.approx(8.0)
    assert row["mttr_reprovisioned_seconds"] == pytest.approx(29.5)
    assert (row["lost_steps_in_place"], row["lost_steps_reprovisioned"]) == (2, 2)
    [data] = json.loads(invoke("cost-report", "restarted", "--json").stdout)
    assert sum(data["goodput_breakdown"].values()) == pytest.approx(data["billed_seconds"])
    assert [r["cause"] for r in data["in_place_details"]] == ["crash", "hang"]


def test_cost_report_text_says_what_the_money_bought_and_where_the_time_went(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    _restarted_run()
    out = " ".join(invoke("cost-report", "restarted").stdout.split())  # the figure lines wrap to the terminal
    assert "what the money bought: eval loss 1.1000 (perplexity 3.00) at step 16; train loss 1.2000 at step 16" in out
    assert "recoveries 1 re-provisioned (MTTR 29.5s), 2 in place (MTTR 8.0s; 1 hang)" in out
    assert "lost steps 4 (8.0s; 2 redone in place)" in out
    assert (
        "of 102.0s billed: useful steps 32.0s, evaluating 5.5s, steps redone in place 4.0s, steps redone on "
        "new machines 4.0s, checkpoint stalls 1.0s, first start-up 20.0s, start-ups on new machines 8.0s, "
        "in-place restarts 24.0s, other 3.5s"
    ) in out
    assert "in-place restarts (same machines, new processes)" in out
    assert "no step for 11.5s (bound 10.0s); rank 0: loop.py:700 train; stacks stacks/hang-1" in out
    listing = invoke("cost-report").stdout
    assert "IN PLACE" in listing and "2 (1 hang)" in listing and "EVAL LOSS" in listing and "1.1000" in listing


def test_a_run_without_evaluation_says_so_and_lists_no_in_place_column():
    make_run()
    out = invoke("cost-report", "run-1").stdout
    assert "what the money bought: no evaluation" in out and "train loss 1.7000 at step 40" in out
    listing = invoke("cost-report").stdout
    assert "IN PLACE" not in listing and "EVAL LOSS" not in listing


def test_status_counts_in_place_restarts_and_hangs_apart_from_recoveries(monkeypatch):
    _restarted_run()
    make_run("plain")
    rows = {r["name"]: r for r in status_rows("-a")}
    row = rows["restarted"]
    assert (row["recoveries"], row["restarts_in_place"], row["hangs"]) == (1, 2, 1)
    assert (row["train_loss"], row["train_loss_step"], row["eval_loss"], row["eval_loss_step"]) == (
        pytest.approx(1.2),
        16,
        1.1,
        16,
    )
    assert (rows["plain"]["restarts_in_place"], rows["plain"]["eval_loss"]) == (0, None)
    monkeypatch.setenv("COLUMNS", "200")
    lines = invoke("status", "-a").stdout.splitlines()
    assert "IN PLACE" in lines[0]
    [restarted] = [line for line in lines if line.startswith("restarted")]
    [plain] = [line for line in lines if line.startswith("plain")]
    assert "2 (1 hang)" in restarted and "hang" not in plain


def test_logs_end_with_the_latest_train_and_eval_loss():
    _restarted_run()
    log = skyspot_home() / "runs" / "restarted" / "logs" / "run.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("step 16/16 | loss 1.2000\n")
    result = invoke("logs", "restarted")
    assert result.exit_code == 0 and result.stdout == "step 16/16 | loss 1.2000\n"  # the log itself, untouched
    assert "latest: train loss 1.2000 (step 16), eval loss 1.1000 (step 16, perplexity 3.00)" in result.stderr
    make_run("no-eval")
    (skyspot_home() / "runs" / "no-eval" / "logs").mkdir()
    (skyspot_home() / "runs" / "no-eval" / "logs" / "run.log").write_text("x\n")
    result = invoke("logs", "no-eval")
    assert "latest: train loss 1.7000 (step 40)" in result.stderr and "eval loss" not in result.stderr


def test_status_and_cost_report_say_what_the_run_ran_on_one_line_per_kind_of_node():
    files = preempted_once_events()
    kind = "g5.48xlarge, image ami-0abc, python 3.10.12 (skyspot venv), driver 580.65.06, torch 2.13.0+cu130"
    files[event_file_name(0, 0, 0)].insert(
        1, _ev(T0 + 5.5, "node", 0, kind=kind, image="ami-0abc", driver="580.65.06", python={"version": "3.10.12"})
    )
    files[event_file_name(1, 0, 0)].insert(
        1, _ev(T0 + 405.5, "node", 1, kind=kind, image="ami-0abc", driver="580.65.06", python={"version": "3.10.12"})
    )
    make_run(files=files)
    (row,) = status_rows()
    (entry,) = json.loads(invoke("cost-report", "run-1", "--json").stdout)
    assert row["node_kinds"] == entry["node_kinds"] and len(row["node_kinds"]) == 1
    assert row["node_kinds"][0]["starts"] == 2 and row["node_kinds"][0]["facts"]["image"] == "ami-0abc"
    text = runner.invoke(app, ["cost-report", "run-1"], terminal_width=400).stdout
    assert f"nodes: {kind} (2 node starts, attempts 0, 1)" in text


def test_a_final_nan_loss_is_said_not_hidden_behind_an_older_one():
    """Issue 31, item 13: a run whose last steps went NaN was reported as "train loss 3.3571 at step 28"."""
    files = preempted_once_events()
    trainer1 = files[event_file_name(1, 0, 0)]
    last = next(i for i, e in enumerate(trainer1) if e["type"] == "step" and e["step"] == 40)
    trainer1[last] = {**trainer1[last], "loss": float("nan")}
    make_run(files=files)
    (entry,) = json.loads(invoke("cost-report", "run-1", "--json").stdout)
    assert entry["final_train_diverged"] is True and entry["final_train_step"] == 40
    assert entry["final_train_loss"] is None
    text = runner.invoke(app, ["cost-report", "run-1"], terminal_width=400).stdout
    assert "train loss not finite (NaN or inf: diverged) at step 40" in text and "train loss 1.7000" not in text
