"""Spot traces and the local executor's spec: what a user writes is checked before anything starts."""

from __future__ import annotations

import pytest

from skyspot.errors import UsageError
from skyspot.executors.local.executor import LocalOptions, make_spec
from skyspot.executors.local.spot_trace import SpotTrace
from skyspot.app.launch import build


def _trace(tmp_path, text: str) -> str:
    path = tmp_path / "trace.yaml"
    path.write_text(text)
    return str(path)


def test_a_trace_is_read_with_every_key(tmp_path):
    trace = SpotTrace.load(
        _trace(tmp_path, "preemptions: [100, 40]\nnotice: 10\ncapacity_gone_after: 2\nnodes: [4, 2, 3]\n")
    )
    assert (trace.preemptions, trace.notice, trace.capacity_gone_after, trace.nodes) == (
        [40.0, 100.0],
        10.0,
        2,
        [4, 2, 3],
    )


def test_a_trace_reads_numbers_as_recipes_do(tmp_path):
    """YAML 1.2's core schema, as for recipes (skyspot/yaml12.py): PyYAML's 1.1 read `010` as 8 and `1:30` as 90."""
    trace = SpotTrace.load(_trace(tmp_path, "preemptions: [010, 0x10]\nnotice: 30\n"))
    assert trace.preemptions == [10.0, 16.0]
    with pytest.raises(UsageError, match="preemptions"):
        SpotTrace.load(_trace(tmp_path, "preemptions: [1:30]\n"))  # a string, not 90 seconds


@pytest.mark.parametrize(
    "text, message",
    [
        ("preemptions: [10]\nwhen: 3\n", "unknown spot trace key(s) when"),
        ("preemptions: [-1]\n", "'preemptions' must be a list of finite seconds >= 0"),
        ("preemptions: [.inf]\n", "'preemptions' must be a list of finite seconds >= 0"),  # issue 31, item 9
        ("preemptions: [.nan]\n", "'preemptions' must be a list of finite seconds >= 0"),
        ("preemptions: [true]\n", "'preemptions' must be a list of finite seconds >= 0"),
        ("preemptions: [1]\nnotice: .inf\n", "'notice' must be finite seconds >= 0"),
        ("preemptions: [1]\nunavailable: [[0, .inf]]\n", "'unavailable' must be a list of"),
        ("preemptions: [1]\nnodes: [2, 0]\n", "'nodes' must be a list of node counts >= 1"),
        ("preemptions: [1]\nnodes: [true]\n", "'nodes' must be a list of node counts >= 1"),
        ("preemptions: [1]\nnodes: 2\n", "'nodes' must be a list"),
        ("- 1\n- 2\n", "a spot trace is a mapping"),
        ("preemptions: [1\n", "malformed spot trace YAML"),
    ],
)
def test_a_bad_trace_is_one_clear_line(tmp_path, text, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        SpotTrace.load(_trace(tmp_path, text))
    assert "\n" not in str(err.value)


def _built(*overrides: str):
    return build("tiny", ["resources.num_nodes=2", "resources.cpu_ranks=1", *overrides], local=True)


def test_spot_node_counts_reach_the_controller_within_min_nodes_and_num_nodes(tmp_path):
    built = _built("resources.min_nodes=1", f"storage.store={tmp_path / 'store'}")
    assert make_spec(built, "r", LocalOptions(spot_nodes=[2, 1, 2])).spot_nodes == [2, 1, 2]
    trace = _trace(tmp_path, "preemptions: [30]\nnodes: [1]\n")
    assert make_spec(built, "r", LocalOptions(spot_trace=trace)).spot_nodes == [1]
    assert make_spec(built, "r", LocalOptions()).spot_nodes == []  # every attempt gets num_nodes
    with pytest.raises(UsageError, match=r"--spot-nodes: 3 node\(s\) above resources.num_nodes \(2\)"):
        make_spec(built, "r", LocalOptions(spot_nodes=[2, 3]))
    with pytest.raises(UsageError, match="once"):
        make_spec(built, "r", LocalOptions(spot_nodes=[2], spot_trace=trace))
    with pytest.raises(UsageError, match=r"1 node\(s\) outside 2\.\.2.*min_nodes"):
        make_spec(_built(), "r", LocalOptions(spot_nodes=[2, 1]))


def test_outages_are_read_sorted_and_mean_no_spot_until_they_end(tmp_path):
    trace = SpotTrace.load(_trace(tmp_path, "preemptions: [5]\nunavailable: [[30, 40], [10, 20]]\n"))
    assert trace.unavailable == [(10.0, 20.0), (30.0, 40.0)]
    assert [trace.available(t) for t in (9, 10, 19.9, 20, 35)] == [True, False, False, True, False]
    assert trace.losses() == [5.0, 10.0, 30.0]  # an outage starts with a notice to a running spot instance
    assert not SpotTrace(capacity_gone_after=1).available(0, preemptions=1)


@pytest.mark.parametrize(
    "text, message",
    [
        ("unavailable: [[20, 10]]\n", "pairs of seconds, 0 <= start < end"),
        ("unavailable: [[1, 2, 3]]\n", "pairs of seconds"),
        ("unavailable: [[0, 30], [20, 40]]\n", "windows overlap at 20s"),
    ],
)
def test_a_bad_outage_is_one_clear_line(tmp_path, text, message):
    with pytest.raises(UsageError, match=message):
        SpotTrace.load(_trace(tmp_path, text))


def test_outages_reach_the_controller_and_a_deadline_refuses_fallback_after(tmp_path):
    built = build("tiny", [], local=True)
    trace = _trace(tmp_path, "unavailable: [[30, 90]]\n")
    assert make_spec(built, "r", LocalOptions(spot_trace=trace)).unavailable == [[30.0, 90.0]]
    with pytest.raises(UsageError, match="drop --fallback-after"):
        make_spec(built, "r", LocalOptions(fallback_after=1, deadline={"at": 1.0, "start": 0.0}))


def test_a_trace_that_is_not_a_small_regular_file_is_one_line_and_never_hangs(tmp_path):
    """Issue 31, item 9: `--spot-trace /dev/zero` was a MemoryError, a FIFO hung the launch."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_text("preemptions: [1]\n" + "#" * (2 << 20) + "\n")
    for path, said in (
        (fifo, "not a readable regular file"),
        ("/dev/zero", "not a readable regular file"),
        (big, "is larger than 1024 KiB"),
        (tmp_path / "gone.yaml", "No such file or directory"),
        (tmp_path, "not a readable regular file"),
    ):
        with pytest.raises(UsageError, match=said) as err:
            SpotTrace.load(str(path))
        assert "\n" not in str(err.value)
