"""A small cache of what `render` and `recipes` print, so repeating them skips loading the recipe models.

Loading a recipe means importing pydantic and building its models, about half of those commands'
start-up (docs/benchmarks.md). Their output depends only on their inputs, so an entry is keyed by
every one of them:

- the command and its arguments, the working directory and HOME (relative and `~` paths resolve
  against them), and every SKYSPOT_* and SKY_* variable;
- the bytes of a recipe file named by path;
- the name, size and modification time of every file in the installed skyspot package: its code,
  its registry recipes and its price snapshot;
- for `render` (`history=True`), what its candidates' order reads: the ledger's files (size and
  modification time: every run recorded or updated), the stamp of the cloud runs' events copied by
  `status` (skyspot/events_copy.py) and the day, since the preemption history decays
  (skyspot/planning/spot_risk.py);
- the modification times of the directories on sys.path, which change when a package is
  installed, upgraded or removed (`render` pins the installed versions for the nodes).

An entry may also name files its output refers to (the wheel folder `render` mounts); when one
is gone the entry is a miss.

Any change is a miss, and a miss runs the command as if there were no cache. Only output of a
command that succeeded is stored. Entries live in `$SKYSPOT_HOME/cache/` (0700, files 0600), the
newest KEEP of them; a cache that cannot be read or written is ignored, never an error.
"""

from __future__ import annotations

import hashlib
import os
import stat as stat_module
import sys
from pathlib import Path
from typing import Iterable, Optional

KEEP = 64
_PACKAGE = Path(__file__).resolve().parents[1]


def key(command: str, args: Iterable[str], files: Iterable[str] = (), *, history: bool = False) -> str:
    digest = hashlib.sha256()
    if history:
        digest.update(_history_signature().encode())
    for part in (command, *args, "\0cwd", os.getcwd(), os.environ.get("HOME", ""), sys.version):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\0")
    for name in sorted(os.environ):
        if name.startswith(("SKYSPOT_", "SKY_")) and name != "SKYSPOT_HOME":
            digest.update(f"{name}={os.environ[name]}".encode("utf-8", "surrogateescape") + b"\0")
    for name in files:
        digest.update(b"\0file\0" + _file_bytes(name))
    digest.update(_package_signature().encode())
    for entry in sys.path:
        try:
            digest.update(f"{entry}:{os.stat(entry or '.').st_mtime_ns}".encode("utf-8", "surrogateescape"))
        except OSError:
            continue
    return digest.hexdigest()[:40]


def get(entry: str) -> Optional[str]:
    """The cached output, or None: no entry, an unreadable one, or one whose files are gone."""
    import json

    folder = _folder()
    if folder is None:
        return None
    try:
        record = json.loads((folder / entry).read_text(encoding="utf-8"))
        if all(Path(path).exists() for path in record["needs"]):
            return str(record["text"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def put(entry: str, text: str, needs: Iterable[str] = ()) -> None:
    import json

    folder = _folder(create=True)
    if folder is None:
        return
    tmp = folder / f".{entry}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"text": text, "needs": [str(p) for p in needs]}, handle)
        os.replace(tmp, folder / entry)
        _prune(folder)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def _home() -> Path:
    # As ledger.skyspot_home resolves it (without making it: a cache never creates the home).
    return Path(os.path.abspath(os.path.expanduser(os.environ.get("SKYSPOT_HOME") or Path.home() / ".skyspot")))


def _history_signature() -> str:
    import time

    parts = [f"day={int(time.time() // 86400)}"]
    for name in ("ledger.db", "ledger.db-wal"):
        try:
            stat = (_home() / name).stat()
            parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            parts.append(f"{name}:-")
    # A new token with every copy of a cloud run's events that changed (skyspot/events_copy.py: FOLDER/STAMP,
    # spelled here as the ledger's files are, so a cache hit imports nothing more): the history changed.
    stamp = _home() / "store-events" / ".stamp"
    try:
        if not stat_module.S_ISREG(os.stat(stamp).st_mode):  # never open a FIFO planted in its place
            raise IsADirectoryError(stamp)
        with open(stamp, "rb") as file:
            parts.append("store-events:" + file.read(200).hex())
    except OSError:
        parts.append("store-events:-")
    return "\0".join(parts)


def _folder(create: bool = False) -> Optional[Path]:
    folder = _home() / "cache"
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError:
            return None
    return folder if folder.is_dir() else None


def _prune(folder: Path) -> None:
    entries = []
    for path in folder.iterdir():
        try:
            entries.append((path.stat().st_mtime, path))
        except OSError:
            continue
    for _, path in sorted(entries, reverse=True)[KEEP:]:
        try:
            path.unlink()
        except OSError:
            pass


def _file_bytes(name: str, limit: int = 1 << 20) -> bytes:
    """A regular file's resolved path and (at most `limit` of) its bytes; a FIFO or device is never read."""
    try:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            return b"(not a file)"
        with open(path, "rb") as handle:
            return str(path).encode("utf-8", "surrogateescape") + b"\0" + handle.read(limit + 1)
    except (OSError, ValueError, RuntimeError):
        return b"(none)"


def _package_signature() -> str:
    parts = []
    stack = [_PACKAGE]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name == "__pycache__" or entry.name.startswith("."):
                continue
            try:
                if entry.is_dir():
                    stack.append(Path(entry.path))
                else:
                    stat = entry.stat()
                    parts.append(f"{entry.path}:{stat.st_size}:{stat.st_mtime_ns}")
            except OSError:
                continue
    return "|".join(sorted(parts))
