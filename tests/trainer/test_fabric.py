"""Which transport NCCL chose (trainer/fabric.py): NCCL's own INFO lines, the environment it ran with,
gloo on CPU; the warning for a multi-node run on sockets; and cost-report showing it per attempt.

The NCCL lines are NCCL's as its source prints them (src/init.cc "Using network %s"; the IB and OFI
lines are from published NCCL logs: NVIDIA/nccl#226, #229). No GPU here: real NCCL runs only on one."""

from __future__ import annotations


import pytest

from skyspot.pricing import cost
from skyspot.events import EventLog, EventWriter, read_events_dir
from skyspot.trainer import fabric

EFA_LOG = """\
ip-10-0-0-1:4242:4300 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v7)
ip-10-0-0-1:4242:4300 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
ip-10-0-0-1:4242:4300 [0] NCCL INFO Using network AWS Libfabric
ip-10-0-0-1:4242:4300 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [receive] via NET/AWS Libfabric/0/GDRDMA
"""
IB_LOG = """\
nd96:777:800 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.4<0>
nd96:777:800 [0] NCCL INFO Using network IB
"""
SOCKET_LOG = """\
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/IB : No device found.
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.12.210<0>
ip-172-31-12-21:45361:45361 [0] NCCL INFO Using network Socket
"""
TCPX_LOG = "a3:1:2 [0] NCCL INFO Using network GPUDirectTCPX\n"


@pytest.mark.parametrize(
    ("text", "transport", "gdr"),
    [
        (EFA_LOG, "ofi", True),
        (IB_LOG, "ib", False),
        (SOCKET_LOG, "socket", False),
        (TCPX_LOG, "tcpx", False),
        (
            "nd96:7:8 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE\nnd96:7:8 [0] NCCL INFO Using network IB\n",
            "roce",
            False,
        ),
        ("no such line\n", "unknown", False),
    ],
)
def test_nccls_own_line_says_which_transport_it_chose(text, transport, gdr):
    found = fabric.from_log(text)
    assert found["transport"] == transport and found["gdr"] is gdr
    if transport == "ofi":
        assert found["network"] == "AWS Libfabric (efa)"


def test_only_the_node_leader_with_nccl_is_asked_and_a_tasks_own_nccl_debug_wins(tmp_path):
    env: dict[str, str] = {}
    assert fabric.prepare(tmp_path, backend="gloo", node_leader=True, environ=env) is None and env == {}
    assert fabric.prepare(tmp_path, backend="nccl", node_leader=False, environ=env) is None and env == {}
    mine = {"NCCL_DEBUG": "WARN"}
    assert fabric.prepare(tmp_path, backend="nccl", node_leader=True, environ=mine) is None
    assert mine == {"NCCL_DEBUG": "WARN"}
    directory = fabric.prepare(tmp_path / "run", backend="nccl", node_leader=True, environ=env)
    assert directory == tmp_path / "run" / "nccl" and directory.is_dir()
    assert env == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": str(directory / "nccl.%h.%p.log"),
    }


def _events(tmp_path, node_rank=0):
    return EventWriter(tmp_path, "run-1", 0, node_rank, node_rank * 8)


def test_a_multi_node_run_on_sockets_is_warned_about_in_the_log_and_the_event(tmp_path):
    directory = tmp_path / "nccl"
    directory.mkdir()
    (directory / "nccl.ip-172-31-12-21.4242.log").write_text(SOCKET_LOG)  # what NCCL_DEBUG_FILE expands to
    said: list[str] = []
    fields = fabric.record(
        directory,
        backend="nccl",
        num_nodes=4,
        events=_events(tmp_path),
        pid=4242,
        environ={"NCCL_SOCKET_IFNAME": "ens3", "HF_TOKEN": "hf_secret"},
        say=said.append,
    )
    assert fields["transport"] == "socket" and fields["source"] == "nccl log"
    assert fields["env"] == {"NCCL_SOCKET_IFNAME": "ens3"}  # the NCCL variables only: no other value
    assert said[0] == "fabric: 4 node(s) on socket (Socket); not probed"  # the one line every start says
    assert len(said) == 2 and said[1].startswith("warning: the fabric between 4 nodes is plain TCP (socket)")
    (event,) = [e for e in read_events_dir(tmp_path / "events").events if e["type"] == "fabric"]
    assert event["warning"] == fields["warning"] and "hf_secret" not in str(event)
    assert event["on_sockets"] is True and "refused" not in event  # the default is to warn
    # One node on sockets is no warning: nothing crosses a network.
    alone = fabric.record(directory, backend="nccl", num_nodes=1, pid=4242, environ={}, say=said.append)
    assert alone["transport"] == "socket" and "warning" not in alone and len(said) == 3


def test_without_nccls_log_the_environment_says_what_it_can_and_gloo_is_gloo(tmp_path):
    forced = fabric.record(None, backend="nccl", num_nodes=2, environ={"NCCL_NET": "Socket"}, say=lambda _: None)
    assert (forced["transport"], forced["source"]) == ("socket", "env") and forced["warning"]
    assert fabric.record(None, backend="nccl", num_nodes=2, environ={}, say=print)["transport"] == "unknown"
    cpu = fabric.record(tmp_path, backend="gloo", num_nodes=2, environ={}, say=print)
    assert (cpu["transport"], cpu["source"]) == ("gloo", "backend") and "warning" not in cpu


def test_cost_report_shows_each_attempts_transport(tmp_path, monkeypatch):
    base = {"run_id": "r", "rank": 0}
    where = {"cloud": "aws", "region": "us-east-1", "instance_type": "p4de.24xlarge", "spot": True, "num_nodes": 2}
    events = [
        {**base, "ts": 1.0, "attempt": 0, "node_rank": 0, "type": "start", "where": where},
        {
            **base,
            "ts": 2.0,
            "attempt": 0,
            "node_rank": 0,
            "type": "fabric",
            "transport": "socket",
            "warning": "NCCL is on plain TCP sockets between 2 nodes",
        },
        {**base, "ts": 2.0, "attempt": 0, "node_rank": 1, "rank": 8, "type": "fabric", "transport": "socket"},
        {**base, "ts": 100.0, "attempt": 1, "node_rank": 0, "type": "start", "where": where},
        {**base, "ts": 101.0, "attempt": 1, "node_rank": 0, "type": "fabric", "transport": "ofi"},
        {**base, "ts": 3700.0, "attempt": 1, "node_rank": 0, "type": "exit", "code": 0, "reason": "complete"},
    ]
    run = cost.run_cost(EventLog(events=events))
    assert [a.transport for a in run.attempts] == ["socket", "ofi"]
    assert any("attempt 0, node 0: NCCL is on plain TCP sockets" in w for w in run.warnings)

    from skyspot.cli import cost as cli_cost

    rows = [cli_cost._attempt_row(a.to_dict()) for a in run.attempts]
    assert [r["fabric"] for r in rows] == ["socket !", "ofi"]  # marked: its node warned
    assert any(c.key == "fabric" and c.header == "FABRIC" for c in cli_cost.ATTEMPT_COLUMNS)


PROBE = {
    "busbw_gbps": 20.0,
    "algbw_gbps": 10.67,
    "probe_bytes": 256 << 20,
    "probe_iters": 20,
    "probe_seconds": 0.025,
    "probe_world_size": 16,
}
P4D = {"cloud": "aws", "instance_type": "p4d.24xlarge"}


def test_the_event_carries_the_probe_and_what_the_instance_type_should_carry(tmp_path):
    directory = tmp_path / "nccl"
    directory.mkdir()
    (directory / "nccl.ip-10-0-0-1.4242.log").write_text(EFA_LOG)
    said: list[str] = []
    # One EFA interface of four (SkyPilot's example: about 20 GB/s on two p4d): below half of 50 GB/s.
    fields = fabric.record(
        directory,
        backend="nccl",
        num_nodes=2,
        events=_events(tmp_path),
        pid=4242,
        environ={},
        say=said.append,
        probe=PROBE,
        where=P4D,
    )
    assert fields["below_expected"] is True and "refused" not in fields
    assert said[0] == (
        "fabric: 2 node(s) on ofi (AWS Libfabric (efa)); all-reduce of 256 MiB x 20: bus bandwidth "
        "20.00 GB/s; expected 50 GB/s (p4d.24xlarge 4 x 100 Gb/s EFA) BELOW"
    )
    assert said[1].startswith(
        "warning: the fabric between 2 nodes is below 0.5 of what it should carry: measured "
        "20.00 GB/s bus bandwidth on ofi, expected 50 GB/s"
    )
    (event,) = [e for e in read_events_dir(tmp_path / "events").events if e["type"] == "fabric"]
    assert (event["busbw_gbps"], event["probe_bytes"], event["probe_iters"], event["transport"]) == (
        20.0,
        256 << 20,
        20,
        "ofi",
    )
    assert event["expected_gbps"] == 50.0 and event["below_expected"] is True and event["require"] == "warn"
    assert "efa-acc-inst-types" in event["expected_source"]
    # Four interfaces (about 78 GB/s in SkyPilot's example): nothing to say beyond the line.
    healthy = fabric.record(
        directory,
        backend="nccl",
        num_nodes=2,
        pid=4242,
        environ={},
        say=said.append,
        probe={**PROBE, "busbw_gbps": 78.0},
        where=P4D,
    )
    assert healthy["below_expected"] is False and "warning" not in healthy and len(said) == 3


def test_require_best_refuses_a_short_fabric_in_one_line_with_both_figures(tmp_path):
    said: list[str] = []
    short = fabric.record(
        None,
        backend="nccl",
        num_nodes=2,
        environ={"NCCL_NET": "AWS Libfabric"},
        say=said.append,
        probe=PROBE,
        where=P4D,
        require="best",
    )
    assert short["refused"] == (
        "fabric.require=best: the fabric between 2 nodes is below 0.5 of what it should "
        "carry: measured 20.00 GB/s bus bandwidth on ofi, expected 50 GB/s (p4d.24xlarge 4 x "
        "100 Gb/s EFA); refusing to start (fabric.require=warn trains on it with a warning)"
    )
    assert len(said) == 1  # the summary; the refusal is the start's one error line, said once by the trainer
    cpu = fabric.record(
        tmp_path,
        backend="gloo",
        num_nodes=2,
        environ={},
        say=said.append,
        probe={**PROBE, "busbw_gbps": 0.9},
        require="best",
    )
    assert cpu["refused"].startswith(
        "fabric.require=best: the fabric between 2 nodes is plain TCP (gloo): "
        "measured 0.90 GB/s bus bandwidth, no expected figure for this instance type"
    )
    one_node = fabric.record(tmp_path, backend="gloo", num_nodes=1, environ={}, say=said.append, require="best")
    assert "refused" not in one_node and one_node["expected_gbps"] is None


def test_status_and_cost_report_show_the_measured_fabric_and_mark_a_short_one(tmp_path):
    from skyspot.cli.common import fabric_text
    from skyspot.cli import cost as cli_cost

    where = {"cloud": "aws", "region": "us-east-1", "instance_type": "p4d.24xlarge", "spot": True, "num_nodes": 2}
    base = {"run_id": "r", "attempt": 0, "type": "fabric", "transport": "ofi", "expected_gbps": 50.0}
    events = [
        {"run_id": "r", "rank": 0, "ts": 1.0, "attempt": 0, "node_rank": 0, "type": "start", "where": where},
        {
            **base,
            "ts": 2.0,
            "node_rank": 0,
            "rank": 0,
            "busbw_gbps": 20.0,
            "below_expected": True,
            "warning": "the fabric between 2 nodes is below 0.5 of what it should carry",
        },
        {**base, "ts": 2.0, "node_rank": 1, "rank": 8, "busbw_gbps": 21.5, "below_expected": True},
        {
            "run_id": "r",
            "rank": 0,
            "ts": 3700.0,
            "attempt": 0,
            "node_rank": 0,
            "type": "exit",
            "code": 0,
            "reason": "complete",
        },
    ]
    run = cost.run_cost(EventLog(events=events))
    (attempt,) = run.attempts
    assert attempt.fabric["busbw_gbps"] == 20.0 and attempt.fabric["below_expected"] is True  # the slowest node
    assert cli_cost._attempt_row(attempt.to_dict())["fabric"] == "ofi 20/50 GB/s !"
    assert fabric_text({"transport": "gloo", "busbw_gbps": 0.879, "expected_gbps": None}) == "gloo 0.879 GB/s"
    assert fabric_text(None, "socket") == "socket" and fabric_text(None) == "-"
