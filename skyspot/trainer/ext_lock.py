"""No op-build lock outlives its holder: stale `lock` files in torch's extensions directory, removed.

DeepSpeed builds its ops (the CPU shared-memory comm op, DeepSpeedCPUAdam) with torch's
cpp_extension, which serialises builders on `<TORCH_EXTENSIONS_DIR>/<python-and-cuda>/<op>/lock`
(torch/utils/file_baton.py, `FileBaton`): created exclusively, held open by the building process,
removed when its build ends. A builder that dies (a cancel during `prepare`, the watchdog's SIGKILL
of a worker) leaves the file, and every later builder or loader of that op waits on it forever:
`~/.cache/torch_extensions` is shared by every venv on the machine, so one cancel hung every later
run (issue 31, item 5).

A lock is stale when no process on this machine holds it open (every /proc/<pid>/fd is read; a
process whose descriptors cannot be read counts as a holder) and it is older than FRESH_S (the
instant between FileBaton's close and its remove is not mistaken for a dead holder). `prepare`
clears stale locks before it builds, and each node leader before its trainer loads any op. Torch's
own code is used as it is; this is what its baton lacks (it records no holder), written here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

FRESH_S = 10.0


def extensions_root(environ=os.environ) -> Path:
    """Where torch's cpp_extension builds (torch.utils.cpp_extension._get_build_directory's root)."""
    chosen = environ.get("TORCH_EXTENSIONS_DIR")
    return Path(chosen) if chosen else Path(environ.get("HOME", "~")).expanduser() / ".cache" / "torch_extensions"


def _open_files(proc: Path = Path("/proc")) -> tuple[set[str], bool]:
    """Every file some process holds open, and whether some process's descriptors could not be read."""
    held: set[str] = set()
    unreadable = False
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    held.add(os.readlink(fd))
                except OSError:
                    continue
        except PermissionError:
            unreadable = True
        except OSError:
            continue  # gone meanwhile
    return held, unreadable


def stale_locks(root: Path, *, now: Optional[float] = None, proc: Path = Path("/proc")) -> list[Path]:
    """The op-build locks under `root` (`*/lock`, `*/*/lock`) no live process holds, older than FRESH_S."""
    locks = [p for pattern in ("*/lock", "*/*/lock") for p in root.glob(pattern) if p.is_file()]
    if not locks:
        return []
    held, unreadable = _open_files(proc)
    if unreadable:
        return []  # another user's process might be building: never take a lock that may be live
    now = time.time() if now is None else now
    stale = []
    for lock in locks:
        try:
            old = now - lock.stat().st_mtime > FRESH_S
        except OSError:
            continue
        if old and str(lock.resolve()) not in held and str(lock) not in held:
            stale.append(lock)
    return stale


def clear_stale(root: Optional[Path] = None, say: Callable[[str], None] = lambda line: None) -> list[Path]:
    """Remove the stale op-build locks under `root` (default: torch's extensions directory); returns them."""
    removed = []
    for lock in stale_locks(extensions_root() if root is None else root):
        try:
            lock.unlink()
        except OSError:
            continue
        removed.append(lock)
        say(f"removed a stale op-build lock no process holds: {lock} (a build that was killed; it is rebuilt)")
    return removed
