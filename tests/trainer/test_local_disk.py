"""The fast tier on local NVMe (trainer/local_disk.py), against a fake /sys/block and mount table."""

from __future__ import annotations

import json
from pathlib import Path

from skyspot.events import EventWriter, read_events_dir
from skyspot.trainer import local_disk
from skyspot.trainer.local_disk import MD_DEVICE, find_devices, link, plan, record_event, run

ROOT_MOUNTS = "/dev/nvme0n1p1 / ext4 rw 0 0\n"
NODE = {"SKYPILOT_CLUSTER_INFO": '{"cloud": "AWS", "region": "us-east-1"}'}


def fake_sys(tmp_path: Path, disks: dict[str, str], *, partitioned=(), held=()) -> Path:
    """/sys/block with one entry per disk: its model and a size of 2 TB (sectors of 512 bytes)."""
    root = tmp_path / "sys" / "block"
    for name, model in disks.items():
        entry = root / name
        (entry / "device").mkdir(parents=True)
        (entry / "device" / "model").write_text(model + "\n")
        (entry / "size").write_text(str(2 * 10**12 // 512))
        (entry / "holders").mkdir()
        if name in partitioned:
            (entry / f"{name}p1").mkdir()
        if name in held:
            (entry / "holders" / "md127").mkdir()
    return root


P4DE = {
    "nvme0n1": "Amazon Elastic Block Store",
    **{f"nvme{i}n1": "Amazon EC2 NVMe Instance Storage" for i in range(1, 9)},
}


def test_a_p4de_stripes_its_eight_instance_store_drives_and_never_touches_ebs(tmp_path):
    sys_block = fake_sys(tmp_path, P4DE, partitioned=["nvme0n1"])
    devices = find_devices(sys_block, ROOT_MOUNTS)
    assert [d.name for d in devices] == [f"nvme{i}n1" for i in range(1, 9)]  # the EBS root volume is not local
    chosen = plan(devices, ROOT_MOUNTS, user="ubuntu", sys_block=sys_block)
    assert chosen.mountpoint == local_disk.MOUNT
    assert chosen.commands[0] == [
        "sudo",
        "mdadm",
        "--create",
        MD_DEVICE,
        "--level=0",
        "--raid-devices=8",
        "--force",
        "--run",
        *[f"/dev/nvme{i}n1" for i in range(1, 9)],
    ]
    assert chosen.commands[1][:2] == ["sudo", "mkfs.ext4"] and chosen.commands[1][-1] == MD_DEVICE
    assert chosen.commands[-2] == ["sudo", "mount", "-o", "noatime", MD_DEVICE, local_disk.MOUNT]
    assert chosen.commands[-1] == ["sudo", "chown", "ubuntu", local_disk.MOUNT]
    assert "8 local NVMe device(s), 16,000 GB, striped" in chosen.reason


def test_one_gcp_local_ssd_is_formatted_alone_and_persistent_disks_are_left_out(tmp_path):
    sys_block = fake_sys(tmp_path, {"nvme0n1": "nvme_card-pd", "nvme0n2": "nvme_card"})
    chosen = plan(find_devices(sys_block, ""), "", user="u", sys_block=sys_block)
    assert not any(c[1] == "mdadm" for c in chosen.commands)
    assert chosen.commands[0][-1] == "/dev/nvme0n2"


def test_what_the_cloud_mounted_already_is_used_as_it_is(tmp_path):
    sys_block = fake_sys(tmp_path, {"nvme0n1": "Microsoft NVMe Direct Disk"})
    mounts = ROOT_MOUNTS + "/dev/nvme0n1 /mnt/resource_nvme xfs rw 0 0\n"
    devices = find_devices(sys_block, mounts)
    assert devices[0].busy == "mounted at /mnt/resource_nvme"
    chosen = plan(devices, mounts, sys_block=sys_block)
    assert (chosen.mountpoint, chosen.commands) == ("/mnt/resource_nvme", [])


def test_without_free_local_nvme_the_run_directory_stays_on_the_root_disk(tmp_path):
    sys_block = fake_sys(tmp_path, {"nvme1n1": "Amazon EC2 NVMe Instance Storage"}, held=["nvme1n1"])
    chosen = plan(find_devices(sys_block, ""), "", sys_block=sys_block)
    assert chosen.mountpoint is None and "nvme1n1 part of md127" in chosen.reason
    assert plan([], "").reason == "no local NVMe"
    lines = []
    assert (
        run(
            ["--link", str(tmp_path / "runs")],
            sys_block=tmp_path / "nothing",
            mounts_text="",
            say=lines.append,
            environ=NODE,
        )
        == 0
    )
    assert lines == ["local disk: no local NVMe; run directories stay on the root disk"]
    assert not (tmp_path / "runs").exists()


def test_a_failing_command_leaves_everything_on_the_root_disk(tmp_path):
    sys_block = fake_sys(tmp_path, {"nvme1n1": "Amazon EC2 NVMe Instance Storage"})
    lines, ran = [], []
    code = run(
        ["--link", str(tmp_path / "runs"), "--mount", str(tmp_path / "mnt")],
        sys_block=sys_block,
        mounts_text="",
        say=lines.append,
        execute=lambda c: ran.append(c) or (1 if "mkfs.ext4" in c else 0),
        environ=NODE,
    )
    assert code == 0 and len(ran) == 1 and "failed (exit 1)" in lines[0] and not (tmp_path / "runs").is_symlink()
    # The NVMe is there but unused: the record says so, and the trainer's event and log say it again.
    record = json.loads((tmp_path / "runs" / ".local_disk.json").read_text())
    assert record["used"] is False and "mkfs.ext4" in record["reason"] and record["devices"] == ["nvme1n1"]


def test_nvme_left_unused_is_said_in_setup_the_trainers_log_and_its_event(tmp_path, capsys):
    sys_block = fake_sys(tmp_path, {"nvme1n1": "Amazon EC2 NVMe Instance Storage"}, held=["nvme1n1"])
    runs, lines = tmp_path / "runs", []
    assert run(["--link", str(runs)], sys_block=sys_block, mounts_text="", say=lines.append, environ=NODE) == 0
    assert lines == [
        "local disk: every local NVMe is in use (nvme1n1 part of md127); run directories stay on the root disk"
    ]
    events = EventWriter(runs / "r", "r", 1, 0, 0)
    fields = record_event(runs / "r", events)
    events.close()
    assert fields["used"] is False and "in use" in fields["reason"]
    assert "local NVMe left unused (every local NVMe is in use" in capsys.readouterr().err
    [event] = read_events_dir(runs / "r" / "events").of_type("local_disk")
    assert event["used"] is False
    # A later setup on the same machine still links a runs directory that holds only the record: no run.
    only_record = tmp_path / "runs2"
    only_record.mkdir()
    (only_record / ".local_disk.json").write_text("{}")
    assert link(only_record, str(tmp_path / "mnt"))[0] and only_record.is_symlink()


def test_model_names_match_whatever_the_generation_case_or_padding(tmp_path):
    """Azure's v6 sizes say "Microsoft NVMe Direct Disk v2"; sysfs pads model strings with spaces."""
    sys_block = fake_sys(
        tmp_path,
        {
            "nvme0n1": "Microsoft NVMe Direct Disk v2",
            "nvme1n1": "MICROSOFT  NVMe Direct Disk   ",
            "nvme2n1": "Amazon EC2 NVMe Instance Storage",
            "nvme3n1": "nvme_card",
            "nvme4n1": "nvme_card-pd",
            "nvme5n1": "nvme_card-hd",
            "nvme6n1": "MSFT NVMe Accelerator v1.0",
            "nvme7n1": "Amazon Elastic Block Store",
            "nvme8n1": "Some Vendor NVMe SSD",
        },
    )
    assert [d.name for d in find_devices(sys_block, "")] == ["nvme0n1", "nvme1n1", "nvme2n1", "nvme3n1"]
    assert local_disk.unknown_devices(sys_block) == [("nvme8n1", "Some Vendor NVMe SSD")]
    lines = []
    run(
        ["--link", str(tmp_path / "runs"), "--dry-run"],
        sys_block=fake_sys(tmp_path / "b", {"nvme8n1": "Some Vendor NVMe SSD"}),
        mounts_text="",
        say=lines.append,
    )
    assert (
        lines[0]
        == "local disk: left alone, not a model known as local or network NVMe: nvme8n1 ('Some Vendor NVMe SSD')"
    )


def test_setup_links_the_runs_directory_measures_it_once_and_the_trainer_records_the_figure(tmp_path):
    sys_block = fake_sys(tmp_path, {"nvme1n1": "Amazon EC2 NVMe Instance Storage"})
    mnt, runs = tmp_path / "mnt", tmp_path / "home" / "skyspot" / "runs"
    ran, lines = [], []
    code = run(
        ["--link", str(runs), "--mount", str(mnt), "--measure-mb", "8"],
        sys_block=sys_block,
        mounts_text="",
        say=lines.append,
        execute=lambda c: ran.append(c) or 0,
        environ=NODE,
    )
    assert code == 0 and [c[1] for c in ran] == ["mkfs.ext4", "mkdir", "mount", "chown"]
    assert runs.is_symlink() and runs.resolve() == (mnt / "skyspot-runs").resolve()
    record = json.loads((runs / ".local_disk.json").read_text())
    assert record["write_gbps"] > 0 and record["probe_bytes"] == 8 << 20 and record["devices"] == ["nvme1n1"]
    assert not list((mnt / "skyspot-runs").glob(".skyspot-disk-probe"))
    assert any("GB/s sequential write" in line for line in lines)

    run_dir = runs / "my-run"
    events = EventWriter(run_dir, "my-run", 1, 0, 0)
    assert record_event(run_dir, events)["write_gbps"] == record["write_gbps"]
    events.close()
    [event] = read_events_dir(run_dir / "events").of_type("local_disk")
    assert event["mountpoint"] == str(mnt) and event["write_gbps"] == record["write_gbps"]
    assert record_event(tmp_path / "elsewhere" / "run", None) is None  # no setup record: nothing


def test_a_runs_directory_that_holds_runs_is_never_moved(tmp_path):
    runs = tmp_path / "runs"
    (runs / "old-run").mkdir(parents=True)
    linked, line = link(runs, str(tmp_path / "mnt"))
    assert not linked and "nothing moved" in line and (runs / "old-run").is_dir() and not runs.is_symlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert link(empty, str(tmp_path / "mnt"))[0] and empty.is_symlink()
    assert link(empty, str(tmp_path / "mnt")) == (
        True,
        f"{empty} is on the local NVMe already ({tmp_path / 'mnt' / 'skyspot-runs'})",
    )


def test_dry_run_prints_the_commands_and_changes_nothing(tmp_path, capsys):
    sys_block = fake_sys(tmp_path, P4DE)
    assert (
        run(
            ["--link", str(tmp_path / "runs"), "--dry-run"],
            sys_block=sys_block,
            mounts_text=ROOT_MOUNTS,
            execute=lambda c: 1 / 0,
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(f"sudo mdadm --create {MD_DEVICE} --level=0 --raid-devices=8")
    assert not (tmp_path / "runs").exists()


def test_nothing_happens_off_a_skypilot_node_or_on_a_simulated_one(tmp_path):
    sys_block = fake_sys(tmp_path, P4DE)
    for environ, why in (
        ({}, "not a SkyPilot node"),
        ({"SKYPILOT_CLUSTER_INFO": '{"cloud": "AWS", "simulated": true}'}, "simulated"),
    ):
        lines = []
        assert (
            run(
                ["--link", str(tmp_path / "runs")],
                sys_block=sys_block,
                mounts_text=ROOT_MOUNTS,
                execute=lambda c: 1 / 0,
                say=lines.append,
                environ=environ,
            )
            == 0
        )
        assert why in lines[0] and "nothing changed" in lines[0] and not (tmp_path / "runs").exists()
