"""The fabric's NCCL environment on the node that has it, and the EFA image's owner checked there.

SkyPilot's task `envs` are one set for every candidate of `resources.ordered`, but what NCCL needs is the
fabric's of the machine a node turned out to be (EFA's on a p5, TCPX's on an a3-highgpu-8g, InfiniBand's
on an ND v5). So the task carries them per instance type (`SKYSPOT_FABRIC_ENV`, JSON, from each cloud's
`fabric_env`: skyspot/clouds/) and the node, knowing its instance type from its cloud's metadata
(trainer/instance.py), exports its own:

    eval "$("$PY" -m skyspot.trainer.nccl_env)"       # run: `export K=V` lines, shell-quoted
    "$PY" -m skyspot.trainer.nccl_env --check-image    # setup: exit 2 on an EFA node not on Amazon's AMI

`--check-image`: SkyPilot boots EFA nodes from an AMI found by name, any owner (skyspot/clouds/aws_images.py);
launch resolved Amazon's per region into `SKYSPOT_EFA_IMAGES`, and a node whose own `ami-id` differs (a
look-alike published after the launch, on a recovery days later) stops in setup with one line.

Off a cloud node, or with no table, nothing is read and nothing printed (the local executor stays quiet).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Mapping, Optional

from skyspot.clouds.aws_images import IMAGES_ENV

FABRIC_ENV = "SKYSPOT_FABRIC_ENV"
PREPEND = "SKYSPOT_LIBPATH_PREPEND"
KEEP = "SKYSPOT_LIBPATH_KEEP"  # libpath.py's


def _table(environ: Mapping[str, str], name: str) -> dict:
    try:
        value = json.loads(environ.get(name) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def exports(environ: Mapping[str, str], instance: Optional[Mapping[str, object]]) -> list[str]:
    """The `export` lines for this node: its instance type's entry of SKYSPOT_FABRIC_ENV, or none."""
    table = _table(environ, FABRIC_ENV)
    entry = table.get(str((instance or {}).get("instance_type") or ""))
    if not isinstance(entry, dict):
        return []
    lines = []
    for key, value in sorted(entry.items()):
        if not (isinstance(key, str) and key.isidentifier() and isinstance(value, str)):
            continue
        if key == "NCCL_TOPO_FILE" and not os.path.exists(value):
            continue  # an image without the file (not the HPC image): NCCL's own detection, not a missing file
        if key == PREPEND:  # folders first on LD_LIBRARY_PATH, and kept through libpath.py's clean-up
            lines.append(f'export LD_LIBRARY_PATH={shlex.quote(value)}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"')
            lines.append(f'export {KEEP}={shlex.quote(value)}"${{{KEEP}:+:${KEEP}}}"')
        else:
            lines.append(f"export {key}={shlex.quote(value)}")
    return lines


def image_problem(environ: Mapping[str, str], instance: Optional[Mapping[str, object]]) -> Optional[str]:
    """Why this node's AMI is not the one launch resolved for its region (one line), or None."""
    images = _table(environ, IMAGES_ENV)
    from skyspot.clouds.aws import AWS, is_efa_instance_type

    if not images or not instance or instance.get("cloud") != AWS.name:
        return None
    if not is_efa_instance_type(str(instance.get("instance_type") or "")):
        return None
    region, booted = instance.get("region"), instance.get("image")
    expected = images.get(str(region))
    if expected is None:
        return (
            f"skyspot fabric: this EFA node in {region} has no Amazon EFA image resolved at launch; not training on it"
        )
    if booted != expected:
        return (
            f"skyspot fabric: this EFA node booted {booted}, not Amazon's {expected} for {region} "
            "(SkyPilot finds the EFA AMI by name: docs/clouds.md); not training on it"
        )
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ
    check = "--check-image" in argv
    if not (_table(environ, IMAGES_ENV) if check else _table(environ, FABRIC_ENV)):
        return 0
    from skyspot.trainer import instance as node_instance

    found = node_instance.read(environ)
    if check:
        problem = image_problem(environ, found)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        return 0
    lines = exports(environ, found)
    if lines:
        print("\n".join(lines))
        print(f"skyspot fabric: NCCL environment for {found and found.get('instance_type')} set", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
