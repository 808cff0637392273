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


@pytest.mark.parametrize(("text", "transport", "gdr"), [
    (EFA_LOG, "ofi", True), (IB_LOG, "ib", False), (SOCKET_LOG, "socket", False), (TCPX_LOG, "tcpx", False),
    ("nd96:7:8 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE\nnd96:7:8 [0] NCCL INFO Using network IB\n", "roce",
     False),
    ("no such line\n", "unknown", False)])
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
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                   "NCCL_DEBUG_FILE": str(directory / "nccl.%h.%p.log")}


def _events(tmp_path, node_rank=0):
    return EventWriter(tmp_path, "run-1", 0, node_rank, node_rank * 8)


def test_a_multi_node_run_on_sockets_is_warned_about_in_the_log_and_the_event(tmp_path):
    directory = tmp_path / "nccl"
    directory.mkdir()
    (directory / "nccl.ip-172-31-12-21.4242.log").write_text(SOCKET_LOG)  # what NCCL_DEBUG_FILE expands to
    said: list[str] = []
    fields = fabric.record(directory, backend="nccl", num_nodes=4, events=_events(tmp_path), pid=4242,
                           environ={"NCCL_SOCKET_IFNAME": "ens3", "HF_TOKEN": "hf_secret"}, say=said.append)
    assert fields["transport"] == "socket" and fields["source"] == "nccl log"
    assert fields["env"] == {"NCCL_SOCKET_IFNAME": "ens3"}  # the NCCL variables only: no other value
    assert len(said) == 1 and said[0].startswith("warning: NCCL is on plain TCP sockets between 4 nodes")
    (event,) = [e for e in read_events_dir(tmp_path / "events").events if e["type"] == "fabric"]
    assert event["warning"] == fields["warning"] and "hf_secret" not in str(event)
    # One node on sockets is no warning: nothing crosses a network.
    alone = fabric.record(directory, backend="nccl", num_nodes=1, pid=4242, environ={}, say=said.append)
    assert alone["transport"] == "socket" and "warning" not in alone and len(said) == 1


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
        {**base, "ts": 2.0, "attempt": 0, "node_rank": 0, "type": "fabric", "transport": "socket",
         "warning": "NCCL is on plain TCP sockets between 2 nodes"},
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
    assert [r["fabric"] for r in rows] == ["socket", "ofi"]
    assert any(c.key == "fabric" and c.header == "FABRIC" for c in cli_cost.ATTEMPT_COLUMNS)
