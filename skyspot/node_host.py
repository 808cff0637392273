"""What setup (node_env.py) and the trainer (trainer/node_facts.py) both read about the node they run on:
the NVIDIA driver, where skyspot's own venv is, and the record setup leaves in it.

Standard library only, Python 3.8 on: node_env imports it from inside the wheel before anything is
installed, with whatever interpreter the image has.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Tuple

INSTALLED = "skyspot-node-env.json"
"""In the venv: the wheelhouse key and wheel it holds (a rerun of setup on the same machine installs nothing),
where they came from and how the interpreter was got (node_facts reads it)."""
VENV_ENV = "SKYSPOT_VENV"


def parse_driver(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """'535.183.01' -> (535, 183, 1); None or anything unparsable -> None."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def driver_version() -> Optional[str]:
    """The first GPU's driver version as nvidia-smi reports it; None without a GPU or nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines and parse_driver(lines[0]) else None


def venv_path(environ: Mapping[str, str]) -> Path:
    """Where skyspot's own venv lives: SKYSPOT_VENV, else ~/.skyspot/venv (task/render.py runs its python by path)."""
    chosen = environ.get(VENV_ENV)
    return Path(chosen).expanduser() if chosen else Path(environ.get("HOME", "~")).expanduser() / ".skyspot" / "venv"
