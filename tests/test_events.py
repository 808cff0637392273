"""Events read into typed records in one place (events.parse_event), their types and checkpoint kinds enums
that are their strings, so the JSON written and read stays the same; a type this version does not know is
counted and left out, never a crash."""

from __future__ import annotations

import json

from skyspot.events import (
    EVENT_TYPES,
    CheckpointKind,
    Event,
    EventLog,
    EventType,
    EventWriter,
    parse_event,
    parse_lines,
    read_events_dir,
)


def test_every_event_type_lists_its_fields():
    assert set(EVENT_TYPES) == set(EventType)
    assert EVENT_TYPES["node"] == EVENT_TYPES[EventType.NODE]  # a plain string finds its member


def test_a_line_is_read_into_a_typed_record_that_still_writes_the_same_json():
    line = (
        '{"ts":1.5,"run_id":"r","attempt":2,"node_rank":0,"rank":1,"type":"checkpoint_end","step":8,"kind":"emergency"}'
    )
    event = parse_event(json.loads(line))
    assert isinstance(event, Event) and event.type is EventType.CHECKPOINT_END
    assert (event.ts, event.attempt, event.node_rank, event.rank, event.step) == (1.5, 2, 0, 1, 8)
    assert event["kind"] == CheckpointKind.EMERGENCY and CheckpointKind("emergency") is CheckpointKind.EMERGENCY
    assert json.dumps(event, separators=(",", ":")) == line
    assert event == json.loads(line)  # still the mapping every reader indexes


def test_an_invalid_line_is_no_record():
    assert parse_event({"type": "step", "ts": 1.0}) is None  # a step without its step
    assert parse_event({"type": 3, "ts": 1.0}) is None
    assert parse_event("start") is None


def test_unknown_event_types_are_counted_not_read():
    lines = [
        '{"ts":1,"type":"start","rank":0}',
        '{"ts":2,"type":"from_the_future","rank":0}',
        '{"ts":3,"type":"from_the_future"}',
        '{"ts":4,"type":"teleport"}',
        "not json",
    ]
    log = EventLog()
    parse_lines(lines, "x.jsonl", log)
    assert [e.type for e in log.events] == [EventType.START]
    assert log.unknown_types == {"from_the_future": 2, "teleport": 1} and log.unknown == 3
    assert log.malformed == 1 and log.malformed_where == ["x.jsonl:5"]
    other = EventLog()
    parse_lines(['{"ts":5,"type":"teleport"}'], "y.jsonl", other)
    log.merge(other)
    assert log.unknown_types["teleport"] == 2


def test_the_writer_takes_members_and_strings_and_refuses_other_types(tmp_path):
    writer = EventWriter(tmp_path, "r", 0, 0, 0)
    writer.emit(EventType.STEP, step=1, loss=2.0)
    writer.emit("checkpoint_begin", step=1, kind=CheckpointKind.INTERVAL)
    try:
        writer.emit("teleport")
    except ValueError as error:
        assert "teleport" in str(error)
    else:
        raise AssertionError("an unknown type was written")
    writer.close()
    raw = [
        json.loads(line) for line in (tmp_path / "events" / "attempt-0.node-0.rank-0.jsonl").read_text().splitlines()
    ]
    assert [(e["type"], e.get("kind")) for e in raw] == [("step", None), ("checkpoint_begin", "interval")]
    log = read_events_dir(tmp_path / "events")
    assert [e.type for e in log.of_type(EventType.CHECKPOINT_BEGIN, "step")] == [
        EventType.STEP,
        EventType.CHECKPOINT_BEGIN,
    ]
