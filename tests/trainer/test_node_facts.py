"""The node's facts (trainer/node_facts.py) and the kinds of node a run's reports show (node_kinds.py)."""

from __future__ import annotations

import json
import os
import sys

from skyspot.node_kinds import kind_lines, node_kinds
from skyspot.trainer import node_facts
from tests.builders import event


def test_the_libnccl_a_process_mapped_is_read_from_its_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libz.so.1.2.13\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert (
        node_facts.loaded_library("libnccl", maps) == "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
    )
    assert node_facts.loaded_library("libnccl-net", maps) is None and node_facts.loaded_library("libz", maps)
    assert node_facts.loaded_library("libnccl", tmp_path / "missing") is None


def test_torchs_cuda_line_is_read_from_its_version():
    assert node_facts.cuda_line("2.13.0+cu126", "12.6") == "cu126"
    assert node_facts.cuda_line("2.13.0", "13.0") == "pypi" and node_facts.cuda_line("2.13.0+cpu", None) == "cpu"
    assert node_facts.cuda_line("2.13.0", None) == "cpu"


def test_rdma_devices_are_told_apart_by_their_driver(tmp_path):
    drivers = tmp_path / "drivers"
    for name in ("efa", "mlx5_core"):
        (drivers / name).mkdir(parents=True)
    for device, driver in (("rdmap16s27", "efa"), ("rdmap32s27", "efa"), ("mlx5_0", "mlx5_core")):
        (tmp_path / "ib" / device / "device").mkdir(parents=True)
        os.symlink(drivers / driver, tmp_path / "ib" / device / "device" / "driver")
    found = node_facts.fabric_devices(tmp_path / "ib")
    assert found["efa"] == ["rdmap16s27", "rdmap32s27"] and found["infiniband"] == ["mlx5_0"]
    assert node_facts.fabric_devices(tmp_path / "none") == {"efa": [], "infiniband": [], "tcpx": found["tcpx"]}


def test_this_process_says_what_it_is_and_the_kind_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYSPOT_VENV", sys.prefix)  # this environment stands for skyspot's own venv
    facts = node_facts.collect(os.environ, instance={"image": "ami-0abc", "instance_type": "p5.48xlarge"})
    assert facts["python"]["path"] == sys.executable and facts["python"]["venv"] == "skyspot"
    assert facts["torch"]["version"].startswith("2.13.0") and facts["gpus"]["count"] == 0
    assert facts["kind"].startswith("p5.48xlarge, image ami-0abc, python ")
    assert "(skyspot venv)" in facts["kind"] and facts["kind"].endswith("fabric tcp")
    json.dumps(facts)  # an event's fields
    assert node_facts.summary_line(facts).startswith("node: p5.48xlarge")


def _node(ts, attempt, node_rank, kind, **facts):
    return event(ts, "node", attempt, node_rank=node_rank, kind=kind, **facts)


def test_nodes_of_a_run_are_grouped_by_kind_with_their_starts_and_attempts():
    a = "p5.48xlarge, image ami-1, python 3.10.12 (skyspot venv), driver 580.65.06, torch 2.13.0+cu130"
    b = "a3-highgpu-8g, image tcpx, python 3.12.9 (skyspot venv), driver 570.172.08, torch 2.13.0+cu126"
    events = [
        _node(1, 0, 0, a, driver="580.65.06"),
        _node(2, 0, 1, a, driver="580.65.06"),
        _node(3, 1, 0, b, driver="570.172.08"),
        _node(4, 1, 1, b, driver="570.172.08"),
        _node(5, 2, 0, a, driver="580.65.06"),
        event(6, "step", 2, step=1, loss=1.0),
        event(7, "node", 2, node_rank=1, kind=None),
    ]  # no kind: left out
    kinds = node_kinds(events)
    assert [(k["kind"], k["starts"], k["attempts"]) for k in kinds] == [(a, 3, [0, 2]), (b, 2, [1])]
    assert kinds[1]["facts"]["driver"] == "570.172.08"
    assert kind_lines(kinds) == [f"nodes: {a} (3 node starts, attempts 0, 2)", f"nodes: {b} (2 node starts, attempt 1)"]
    assert node_kinds([]) == [] and kind_lines([]) == []
