"""Files a command writes for the user (`render -o`, `cost-report --plot`, `cp`): one way, here.

- atomic: the bytes go to a temp file beside the target (created exclusively, so a planted temp-file
  link cannot redirect them), then take the target's name in one step; a reader never sees half a file
  and a failed write leaves whatever was there;
- never through a link: a link at the target's name is replaced itself (with `--force`), its target
  is never written;
- never over an existing file without `--force`: without it the temp file is *linked* to the name,
  which fails if anything (a file, a link, even a dangling one) is there, so there is no check-then-
  write window;
- never over anything but a regular file or a link, even with `--force`: a device node, a FIFO or a
  socket at the name is refused (a rename over `/dev/null` run as root would make it a plain file);
- the mode is what a new file gets under the umask, or the replaced file's own, never wider than `cap`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Annotated, Optional

import typer

from skyspot.errors import UsageError

ForceOption = Annotated[
    bool, typer.Option("--force", help="Replace the output file if it exists (never what a link there points to).")
]

# Filesystems that cannot hard-link (FAT, some network mounts): the exclusive create is the fallback there.
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def write_output(path: Path, data: bytes, *, force: bool, flag: str, cap: int = 0o666, forceable: bool = True) -> Path:
    """Write `data` to `path` as the module docstring says; the path written. `flag` names the option
    in errors (`-o`, `--plot`); `cap` bounds the mode (a copy is never more open than its source);
    `forceable`: the command has `--force` (`cp` has not: a copy never replaces anything)."""
    path = Path(path)
    existing = check_output(path, force=force, flag=flag, forceable=forceable)
    if existing is not None and stat.S_ISREG(existing.st_mode):
        mode = existing.st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    import tempfile  # here: a command that writes no file does not pay for importing it

    tmp: Optional[str] = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode & cap)
        if force:
            check_output(path, force=True, flag=flag, forceable=forceable)  # again: whatever is there now
            os.replace(tmp, path)  # replaces a link itself, never what it points to
            tmp = None
        else:
            _place_new(tmp, path)
    except FileExistsError:
        raise UsageError(_taken(path, forceable)) from None
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def check_output(path: Path, *, force: bool, flag: str, forceable: bool = True) -> Optional[os.stat_result]:
    """Refuse `path` before any work is done when it cannot be written: a directory, a name taken
    (without `force`), a missing parent. What is there now (lstat), or None."""
    path = Path(path)
    if not str(path).strip():
        raise UsageError(f"{flag} needs a file name")
    try:
        existing: Optional[os.stat_result] = os.lstat(path)
    except FileNotFoundError:
        existing = None
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from None
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise UsageError(f"{flag} {path} is a directory; name a file")
    if existing is not None and not (stat.S_ISREG(existing.st_mode) or stat.S_ISLNK(existing.st_mode)):
        raise UsageError(
            f"{flag} {path} is a {_kind(existing.st_mode)}, not a regular file; nothing was "
            "written. Name a regular file"
        )
    if existing is not None and not force:
        raise UsageError(_taken(path, forceable))
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {path}: directory {path.parent} does not exist")
    return existing


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _taken(path: Path, forceable: bool) -> str:
    return f"{path} already exists; nothing was overwritten. Name a new file" + (
        ", or pass --force" if forceable else ""
    )


def _place_new(tmp: str, path: Path) -> None:
    """Give the finished temp file the name `path`, failing if the name is taken (FileExistsError)."""
    try:
        os.link(tmp, path)
        return
    except OSError as error:
        if error.errno not in _NO_LINKS:
            raise
    # No hard links here: an exclusive create that does not follow links, then the bytes copied in.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, os.stat(tmp).st_mode & 0o777)
    try:
        with open(tmp, "rb") as source, os.fdopen(fd, "wb", closefd=False) as handle:
            handle.write(source.read())
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
