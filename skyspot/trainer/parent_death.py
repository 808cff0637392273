"""Die with the parent: Linux's parent-death signal, set in a child before it runs anything.

`prctl(PR_SET_PDEATHSIG, sig)` makes the kernel send `sig` to this process when the thread that forked
it ends, however it ends (SIGKILL included), and the setting survives `execve` (prctl(2)). A parent
that died before the call sends nothing, so every caller compares `os.getppid()` with the parent it
expects right after. Called through ctypes: neither the standard library nor psutil exposes prctl.
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int) -> bool:
    """Ask for `sig` when this process's parent ends; False off Linux or when the call fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except OSError:
        return False
