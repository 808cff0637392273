"""The fast tier on the node's local NVMe: find it, stripe and mount it, measure it once.

Run by the task's `setup` on every new node, before the trainer starts:

    python -m skyspot.trainer.local_disk --link "$HOME/skyspot/runs"

The 8-GPU instances skyspot's recipes use carry NVMe drives that go with the VM (AWS instance
store on p4d/p4de/p5, GCP local SSD on a2-ultragpu/a3, Azure's NVMe on ND A100 v4 / ND H100 v5),
while SkyPilot's root disk is network storage of a few hundred MB/s (docs/planning.md). This:

1. finds the local NVMe devices in /sys/block by model name, case and spacing aside and any suffix
   after it allowed (`Amazon EC2 NVMe Instance Storage`, GCP's `nvme_card`, `Microsoft NVMe Direct
   Disk` and its `... v2`), after ruling out the network disks that speak NVMe too (EBS, GCP's
   `nvme_card-pd`, Azure's `MSFT NVMe Accelerator`), and leaving out any that hold a mounted
   filesystem, a partition or belong to another device; an NVMe disk of a model it knows neither way
   is left alone and named in the output;
2. uses what the cloud already mounted when one of them is mounted (Azure mounts its NVMe on
   some images); else stripes them (mdadm RAID 0 when there are several), makes an ext4
   filesystem and mounts it at MOUNT (sudo: SkyPilot's images allow it without a password);
3. points `--link` (the directory the task's `run` keeps run directories in) at MOUNT/skyspot-runs
   with a symlink, unless it already holds something (then nothing is moved: one line says so);
4. writes and fsyncs `--measure-mb` MiB there once and records the bandwidth in
   `<link>/.local_disk.json`; the trainer emits it as a `local_disk` event at its next start
   (`record_event`), so the window check (`notice_window.measured_bandwidth`) and the cost report use the
   node's measured disk, not a table.

Nothing here is fatal: without NVMe, or when a command fails, the run directory stays on the root
disk and the trainer works as before (one line says why). When there is NVMe and it goes unused
(every device busy, a command failed, a model it does not know, a runs directory already in use),
the record says so (`used: false`, `reason`), and the trainer's `local_disk` event and log say it too.
`--dry-run` prints the commands only.
It acts only on a SkyPilot node (SKYPILOT_CLUSTER_INFO set, and not the local executor's simulated
one), so a developer's machine is never reformatted; `--force` overrides that.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

MOUNT = "/mnt/skyspot-nvme"
RUNS = "skyspot-runs"
RECORD = ".local_disk.json"
MD_DEVICE = "/dev/md/skyspot"
# Model strings from /sys/block/<dev>/device/model, lower case with runs of spaces folded, matched as
# prefixes (a later generation appends to them: "Microsoft NVMe Direct Disk v2" on Azure's v6 sizes).
# Local (ephemeral) NVMe: AWS instance store, GCP local SSD, Azure's local NVMe.
LOCAL_MODELS = ("amazon ec2 nvme instance storage", "nvme_card", "microsoft nvme direct disk")
# Network disks that also appear as NVMe, checked first (GCP's local SSD name is a prefix of its PD's):
# EBS, GCP persistent disk and Hyperdisk ("nvme_card-pd", any "nvme_card-..."), Azure Boost's remote disks.
REMOTE_MODELS = ("amazon elastic block store", "nvme_card-", "msft nvme accelerator")


def disk_kind(model: str) -> str:
    """ "local", "remote" or "unknown" for an NVMe device's model string."""
    name = " ".join(model.lower().split())
    if any(name.startswith(m) for m in REMOTE_MODELS):
        return "remote"
    if any(name.startswith(m) for m in LOCAL_MODELS):
        return "local"
    return "unknown"


def unknown_devices(sys_block: Path = Path("/sys/block")) -> list[tuple[str, str]]:
    """(name, model) of the NVMe disks whose model is neither a known local nor a known network disk."""
    found = []
    for entry in sorted(sys_block.glob("nvme*n*")):
        model = _read(entry / "device" / "model")
        if disk_kind(model) == "unknown":
            found.append((entry.name, model))
    return found


@dataclass
class Device:
    name: str
    """Kernel name, e.g. nvme1n1."""
    model: str
    size_bytes: int
    busy: str = ""
    """Why it cannot be taken (mounted, partitioned, in an array); empty when free."""


@dataclass
class Plan:
    devices: list[Device]
    mountpoint: Optional[str]
    """Where the fast tier will be (or is already) mounted; None: no local NVMe, stay on the root disk."""
    commands: list[list[str]] = field(default_factory=list)
    reason: str = ""


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def find_devices(sys_block: Path = Path("/sys/block"), mounts_text: Optional[str] = None) -> list[Device]:
    """The local NVMe disks of this machine, each marked busy when something already uses it."""
    mounts = _mounts(mounts_text)
    found = []
    for entry in sorted(sys_block.glob("nvme*n*")):
        name = entry.name
        model = _read(entry / "device" / "model")
        if disk_kind(model) != "local":
            continue
        sectors = _read(entry / "size")
        size = int(sectors) * 512 if sectors.isdigit() else 0
        busy = ""
        mounted_at = mounts.get(f"/dev/{name}")
        if mounted_at:
            busy = f"mounted at {mounted_at}"
        elif any(p.name.startswith(name + "p") for p in entry.iterdir() if p.is_dir()):
            busy = "partitioned"
        elif (entry / "holders").is_dir() and any((entry / "holders").iterdir()):
            holders = sorted(p.name for p in (entry / "holders").iterdir())
            busy = f"part of {', '.join(holders)}"
        found.append(Device(name, model, size, busy))
    return found


def _mounts(text: Optional[str] = None) -> dict[str, str]:
    if text is None:
        try:
            text = Path("/proc/mounts").read_text()
        except OSError:
            text = ""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out.setdefault(parts[0], parts[1].replace("\\040", " "))
    return out


def plan(
    devices: list[Device],
    mounts_text: Optional[str] = None,
    mountpoint: str = MOUNT,
    user: Optional[str] = None,
    sys_block: Path = Path("/sys/block"),
) -> Plan:
    """What to run for these devices. Pure (given the mount table and /sys/block)."""
    mounts = _mounts(mounts_text)
    if mountpoint in mounts.values():
        return Plan(devices, mountpoint, reason=f"{mountpoint} is mounted already")
    # A filesystem the cloud (or an earlier setup) already put on local NVMe: use it as it is.
    for device in devices:
        if device.busy.startswith("mounted at ") and device.busy[len("mounted at ") :] not in ("/", "/boot"):
            return Plan(
                devices, device.busy[len("mounted at ") :], reason=f"/dev/{device.name} is already {device.busy}"
            )
    for md, target in mounts.items():
        if md.startswith("/dev/md") and target not in ("/", "/boot"):
            slaves = sys_block / Path(os.path.realpath(md)).name / "slaves"
            names = {p.name for p in slaves.iterdir()} if slaves.is_dir() else set()
            if names and names <= {d.name for d in devices}:
                return Plan(devices, target, reason=f"{md} (RAID of local NVMe) is mounted at {target}")
    free = [d for d in devices if not d.busy]
    if not free:
        why = (
            "no local NVMe"
            if not devices
            else "every local NVMe is in use (" + "; ".join(f"{d.name} {d.busy}" for d in devices) + ")"
        )
        return Plan(devices, None, reason=why)
    paths = [f"/dev/{d.name}" for d in free]
    commands: list[list[str]] = []
    if len(paths) > 1:
        commands.append(
            [
                "sudo",
                "mdadm",
                "--create",
                MD_DEVICE,
                "--level=0",
                f"--raid-devices={len(paths)}",
                "--force",
                "--run",
                *paths,
            ]
        )
        target = MD_DEVICE
    else:
        target = paths[0]
    # lazy init and no discard: the filesystem is ready in seconds, not minutes, on terabytes of NVMe
    commands += [
        ["sudo", "mkfs.ext4", "-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", target],
        ["sudo", "mkdir", "-p", mountpoint],
        ["sudo", "mount", "-o", "noatime", target, mountpoint],
        ["sudo", "chown", user or _user(), mountpoint],
    ]
    size = sum(d.size_bytes for d in free)
    return Plan(
        devices,
        mountpoint,
        commands,
        f"{len(free)} local NVMe device(s), {size / 1e9:,.0f} GB, "
        + ("striped (RAID 0)" if len(paths) > 1 else "one device"),
    )


def _user() -> str:
    import getpass

    return getpass.getuser()


def link(runs: Path, mountpoint: str) -> tuple[bool, str]:
    """Point `runs` at MOUNT/skyspot-runs. (linked, one line)."""
    target = Path(mountpoint) / RUNS
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    if runs.is_symlink():
        if Path(os.path.realpath(runs)) == Path(os.path.realpath(target)):
            return True, f"{runs} is on the local NVMe already ({target})"
        runs.unlink()
    elif runs.exists():
        if runs.is_dir() and all(p.name == RECORD for p in runs.iterdir()):  # empty but an earlier setup's record
            (runs / RECORD).unlink(missing_ok=True)
            runs.rmdir()
        else:
            return False, f"{runs} already holds run directories; left on the root disk (nothing moved)"
    runs.parent.mkdir(parents=True, exist_ok=True)
    runs.symlink_to(target, target_is_directory=True)
    return True, f"{runs} -> {target}"


def measure(directory: Path, mib: int = 1024, chunk_mib: int = 64) -> dict:
    """Write and fsync `mib` MiB in `directory` once, then delete it: sequential write GB/s (decimal)."""
    data = os.urandom(min(chunk_mib, mib) << 20)
    path = directory / ".skyspot-disk-probe"
    written = 0
    start = time.perf_counter()
    try:
        with open(path, "wb", buffering=0) as f:
            while written < mib << 20:
                written += f.write(data)
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return {"write_gbps": round(written / seconds / 1e9, 3), "probe_bytes": written, "probe_seconds": round(seconds, 3)}


def record_event(run_dir: Path, events) -> Optional[dict]:
    """At a trainer's start (node leader): emit the `local_disk` event for what setup measured, if it did."""
    path = Path(run_dir).parent / RECORD
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict):
        return None
    fields = {
        k: found.get(k)
        for k in (
            "write_gbps",
            "mountpoint",
            "devices",
            "device_bytes",
            "probe_bytes",
            "probe_seconds",
            "measured_at",
            "reason",
        )
    }
    fields["used"] = found.get("used", True) is not False
    if not fields["used"]:
        print(
            f"[skyspot] local disk: local NVMe left unused ({fields['reason']}); the run directory is on the root disk",
            file=sys.stderr,
            flush=True,
        )
    if events is not None:
        events.emit("local_disk", **fields)
    return fields


def _not_a_node(environ) -> Optional[str]:
    raw = environ.get("SKYPILOT_CLUSTER_INFO", "").strip()
    if not raw:
        return "not a SkyPilot node (SKYPILOT_CLUSTER_INFO unset)"
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    if isinstance(info, dict) and info.get("simulated"):
        return "a node simulated by the local executor"
    return None


def run(
    argv: Optional[Sequence[str]] = None,
    *,
    execute: Callable[[list[str]], int] = None,
    say: Callable[[str], None] = lambda line: print(f"[skyspot] {line}", file=sys.stderr, flush=True),
    sys_block: Path = Path("/sys/block"),
    mounts_text: Optional[str] = None,
    environ=None,
) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyspot.trainer.local_disk", description=__doc__.split("\n")[0])
    parser.add_argument("--link", required=True, type=Path, help="the directory the task keeps run directories in")
    parser.add_argument("--mount", default=MOUNT, help=f"where to mount the local NVMe (default {MOUNT})")
    parser.add_argument("--measure-mb", type=int, default=1024, help="MiB written once to measure the disk (0: skip)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, change nothing")
    parser.add_argument("--force", action="store_true", help="act even where this is not a SkyPilot node")
    args = parser.parse_args(argv)
    why_not = None if args.force or args.dry_run else _not_a_node(os.environ if environ is None else environ)
    if why_not:
        say(f"local disk: {why_not}; nothing changed")
        return 0
    execute = execute or (
        lambda command: subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode
    )
    devices = find_devices(sys_block, mounts_text)
    unknown = unknown_devices(sys_block)
    if unknown:
        say(
            "local disk: left alone, not a model known as local or network NVMe: "
            + ", ".join(f"{name} ({model!r})" for name, model in unknown)
        )
    chosen = plan(devices, mounts_text, args.mount, sys_block=sys_block)

    def unused(why: str) -> int:
        """NVMe there, but the run directories stay on the root disk: say it, and record it for the trainer."""
        say(f"local disk: {why}; run directories stay on the root disk")
        if (devices or unknown) and not args.dry_run:
            args.link.mkdir(parents=True, exist_ok=True)
            (args.link / RECORD).write_text(
                json.dumps(
                    {
                        "used": False,
                        "reason": why,
                        "devices": [d.name for d in devices] + [n for n, _ in unknown],
                        "device_bytes": sum(d.size_bytes for d in devices),
                        "measured_at": time.time(),
                    }
                )
            )
        return 0

    if chosen.mountpoint is None:
        return unused(
            chosen.reason
            if devices or not unknown
            else f"no known local NVMe ({len(unknown)} NVMe disk(s) of another model)"
        )
    for command in chosen.commands:
        if args.dry_run:
            print(shlex.join(command))
            continue
        code = execute(command)
        if code != 0:
            return unused(f"`{shlex.join(command)}` failed (exit {code})")
    if args.dry_run:
        print(f"# then: {args.link} -> {chosen.mountpoint}/{RUNS}, and a {args.measure_mb} MiB write to measure it")
        return 0
    linked, line = link(args.link, chosen.mountpoint)
    if not linked:  # mounted, but the runs directory in use is not moved
        return unused(f"{chosen.reason}, mounted at {chosen.mountpoint}; {line}")
    say(f"local disk: {chosen.reason}; {line}")
    record = {
        "used": True,
        "mountpoint": chosen.mountpoint,
        "devices": [d.name for d in devices if not d.busy] or [d.name for d in devices],
        "device_bytes": sum(d.size_bytes for d in devices),
        "reason": chosen.reason,
        "measured_at": time.time(),
    }
    if args.measure_mb > 0:
        try:
            record.update(measure(Path(chosen.mountpoint) / RUNS, args.measure_mb))
            say(
                f"local disk: {record['write_gbps']:.2f} GB/s sequential write (write + fsync of {args.measure_mb} MiB)"
            )
        except OSError as err:
            say(f"local disk: could not measure it ({err})")
    (args.link / RECORD).write_text(json.dumps(record))
    return 0


def main() -> int:
    return run()


if __name__ == "__main__":
    sys.exit(main())
