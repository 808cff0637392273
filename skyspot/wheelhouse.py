"""The run's wheelhouse, and why a node may trust it: files in a bucket, vouched for by a key that is not.

    <store>/<run>/wheelhouse/<key>/    the wheels, requirements.lock, WHEELHOUSE.json (written last)

A wheelhouse is code every node installs, and the bucket that holds it can be written by others than
the one who launched the run (a shared bucket, a leaked store credential). So the bucket alone vouches
for nothing. At launch a per-run random key (`KEY_BYTES`) is made on the launching machine and kept
with the run's record in $SKYSPOT_HOME (`keys/<run>`, mode 0600; never in the ledger, the events,
the logs or the rendered task); `resume` reuses it. It reaches the nodes as a SkyPilot secret
(`KEY_ENV`, declared with no value in the task: task/render.py) or, on the local executor, in the
node's environment. Node 0 signs the marker with HMAC-SHA256 over its canonical JSON (every file's
size and sha256, the lock's among them, and the wheelhouse's own key name); every node checks that
signature, then every file's sha256 while it copies the file off the mount, and installs with hashes
required: the lock holds one `--hash=sha256:` line per wheel in the wheelhouse (DeepSpeed's wheel
built from its sdist included), and uv refuses anything else. A wheelhouse that has no signature, or
one that does not match, or any wheelhouse on a node without the key, is refused in one line and
nothing from it is installed (node_env.py then installs from the index).

What this does not defend: a writer who has the key (it is on the launching machine and in the
nodes' environment), and a replay of a wheelhouse this same run signed before under the same name
(the same requirement set, resolved by one of the run's own nodes).

Standard library only, Python 3.8 syntax: node_env runs this from inside the wheel zip before
anything is installed, with whatever interpreter the image has.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

MARKER = "WHEELHOUSE.json"
"""Written last into a wheelhouse: without it (or with a file it does not vouch for) the wheelhouse does not exist."""
LOCK = "requirements.lock"
KEY_ENV = "SKYSPOT_WHEELHOUSE_KEY"
"""The run's key on a node: a SkyPilot secret (task `secrets:`), the local executor's node environment."""
KEY_BYTES = 32
SIGNATURE = "hmac_sha256"
"""The marker's field holding the HMAC-SHA256 (hex) of the rest of it, canonical JSON, under the run's key."""
KEYS_DIR = "keys"
"""Under $SKYSPOT_HOME: one file per run, its wheelhouse key (hex), mode 0600."""


# ------------------------------------------------------------------ the key, on the launching machine


def key_path(home: Path, run: str) -> Path:
    return Path(home) / KEYS_DIR / run


def new_key(home: Path, run: str) -> str:
    """A fresh key for a new run, replacing any left by an earlier run of that name; returns it (hex)."""
    return _write_key(key_path(home, run), secrets.token_hex(KEY_BYTES))


def run_key(home: Path, run: str) -> str:
    """The run's key: the one made at launch; a run launched before keys existed gets one now (`resume`)."""
    path = key_path(home, run)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return _write_key(path, secrets.token_hex(KEY_BYTES))
    if not re.fullmatch(r"[0-9a-f]{%d}" % (2 * KEY_BYTES), text):
        return _write_key(path, secrets.token_hex(KEY_BYTES))  # damaged: the next wheelhouse is signed anew
    return text


def _write_key(path: Path, key: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=".key.")  # mkstemp: 0600 from its first instant
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(key + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return key


# ------------------------------------------------------------------ the marker and its signature


def node_key(environ: Mapping[str, str]) -> Optional[bytes]:
    """The run's key as a node has it, or None (no key, or not one the launch made)."""
    text = (environ.get(KEY_ENV) or "").strip()
    return bytes.fromhex(text) if re.fullmatch(r"[0-9a-fA-F]{%d}" % (2 * KEY_BYTES), text) else None


def _canonical(marker: Mapping) -> bytes:
    body = {k: v for k, v in marker.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(marker: Mapping, key: bytes) -> dict:
    """The marker with its signature."""
    out = {k: v for k, v in marker.items() if k != SIGNATURE}
    out[SIGNATURE] = hmac.new(key, _canonical(out), hashlib.sha256).hexdigest()
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files_of(local: Path) -> Dict[str, dict]:
    """Every file of a wheelhouse built in `local`: its size and sha256 (what the marker vouches for)."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(local.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.name != MARKER
    }


def read_marker(folder: Path, name: str, key: Optional[bytes]) -> Tuple[Optional[dict], Optional[str]]:
    """(the marker, None) when the wheelhouse `name` in `folder` is signed with the run's key and every file
    it names has its size; else (None, why). The files' bytes are checked by `fetch`, as it copies them."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        if not isinstance(files, dict) or LOCK not in files:
            raise ValueError("no file list")
    except FileNotFoundError:
        return None, "no wheelhouse" if not folder.exists() else f"no {MARKER} (a first start that did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{MARKER} unreadable ({error})"
    if key is None:
        return None, f"this node has no wheelhouse key ({KEY_ENV}), so nothing vouches for it"
    signature = marker.get(SIGNATURE)
    if not isinstance(signature, str):
        return None, f"{MARKER} is not signed with the run's key"
    if not hmac.compare_digest(signature, hmac.new(key, _canonical(marker), hashlib.sha256).hexdigest()):
        return None, f"{MARKER} does not match its signature (not written by this run's nodes)"
    if marker.get("key") != name:
        return None, f"{MARKER} is the wheelhouse {marker.get('key')!r}, found under {name!r}"
    for file, entry in files.items():
        if "/" in file or "\\" in file or file.startswith(".") or not isinstance(entry, dict):
            return None, f"{MARKER} names {file!r} as {entry!r}"
        try:
            size = (folder / file).stat().st_size
        except OSError:
            return None, f"{file} is missing"
        if size != entry.get("size"):
            return None, f"{file} has {size} bytes, {MARKER} says {entry.get('size')}"
    return marker, None


def fetch(folder: Path, local: Path, name: str, key: Optional[bytes]) -> Tuple[Optional[dict], Optional[str]]:
    """Copy a wheelhouse (read through the bucket mount) to `local`, its signature checked first and every
    file's sha256 on the way; on any mismatch nothing is left in `local`."""
    marker, problem = read_marker(folder, name, key)
    if marker is None:
        return None, problem
    if local.exists():
        shutil.rmtree(local)
    local.mkdir(parents=True)
    for file, entry in sorted(marker["files"].items()):
        h = hashlib.sha256()
        with open(folder / file, "rb") as src, open(local / file, "wb") as dst:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                h.update(chunk)
                dst.write(chunk)
        if h.hexdigest() != entry.get("sha256"):
            shutil.rmtree(local, ignore_errors=True)
            return None, f"{file} does not match its sha256 in {MARKER}"
    return marker, None


# ------------------------------------------------------------------ the lock uv installs, hashes required


_WHEEL_NAME = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl")


def hashed_lock(local: Path) -> str:
    """The lock for the wheels in `local`: `name==version --hash=sha256:...` for each wheel file, so
    `uv pip install --require-hashes` installs those exact files and nothing else (DeepSpeed's wheel,
    built here from its sdist, has the hash of the built file, not the index's sdist hash)."""
    lines: List[str] = []
    for wheel in sorted(local.glob("*.whl")):
        match = _WHEEL_NAME.fullmatch(wheel.name)
        if match is None:
            raise ValueError(f"{wheel.name} is not a wheel's file name")
        lines.append(f"{match.group('name')}=={match.group('version')} --hash=sha256:{sha256_of(wheel)}")
    return "\n".join(lines) + "\n"


def own_wheel_requirement(wheel: Path) -> str:
    """skyspot's own wheel as a hashed requirement (it comes from the task's file mount, the launching
    machine's build, so its hash is taken here; hash-checking mode is all or nothing)."""
    match = _WHEEL_NAME.fullmatch(wheel.name)
    name = match.group("name") if match else "skyspot"
    return f"{name} @ {wheel.resolve().as_uri()} --hash=sha256:{sha256_of(wheel)}\n"
