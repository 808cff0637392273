"""The process's environment: the start's own settings made once, then read into a frozen record.

The trainer changes `os.environ` only here, at the very start of setup and before anything reads it:
the rank pinned to the node (cluster.pin_rank), a world of one on loopback without torchrun, and the
tokenizers' thread pool off. Everything after reads `ProcessEnv`, a copy taken right then, so no
later step can see (or make) a different environment. (fabric.prepare still sets NCCL's debug file
for NCCL itself, before the process group starts: that is NCCL's channel, not the trainer's.)
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Mapping

from skyspot.ports import LOOPBACK, free_port
from skyspot.trainer import cluster
from skyspot.trainer.exit_codes import ERROR, TOKEN_ENV
from skyspot.trainer.parent_death import set_parent_death_signal
from skyspot.trainer.preemption import NOTICE_FILE_ENV


@dataclass(frozen=True)
class ProcessEnv:
    """The environment as the start left it (a read-only copy)."""

    environ: Mapping[str, str]

    @property
    def local_world_size(self) -> int:
        """torchrun's LOCAL_WORLD_SIZE; a standalone start is one rank."""
        return int(self.environ.get("LOCAL_WORLD_SIZE") or 1)

    @property
    def dist_timeout(self) -> timedelta:
        """The rendered task sets SKYSPOT_DIST_TIMEOUT_SECONDS so a lost node fails the others fast
        instead of hanging a paid cluster (skyspot/task/render.py DIST_ENV)."""
        return timedelta(seconds=float(self.environ.get("SKYSPOT_DIST_TIMEOUT_SECONDS") or 600))

    @property
    def notice_file(self) -> str:
        """The node supervisor's notice file, when it watches for notices (preemption.NoticeFile)."""
        return self.environ.get(NOTICE_FILE_ENV, "").strip()

    @property
    def supervisor_token(self) -> str:
        return self.environ.get(TOKEN_ENV, "")

    @property
    def is_global_zero(self) -> bool:
        return self.environ.get("RANK", "0") == "0"

    @property
    def is_node_leader(self) -> bool:
        return self.environ.get("LOCAL_RANK", "0") == "0"

    @property
    def rank(self) -> int:
        return int(self.environ.get("RANK") or 0)


def read() -> ProcessEnv:
    """The environment now, copied (also where no start got as far as `start`: an early failure)."""
    return ProcessEnv(MappingProxyType(dict(os.environ)))


def start() -> ProcessEnv:
    """The start's own settings, each once and before anything reads it; then the record."""
    cluster.pin_rank()  # before anything reads RANK: the ranks stay with their node (cluster.py)
    _standalone_env()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return read()


def _standalone_env() -> None:
    """Allow `python -m skyspot.trainer` without torchrun: a world of one on loopback."""
    if "RANK" in os.environ:
        return
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())}
    )


def die_with_parent() -> None:
    """SIGKILL this worker if torchrun dies, so an orphan can never write into DIR beside the next start."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if not set_parent_death_signal(signal.SIGKILL):
        return
    if os.getppid() != parent or not is_launcher(parent):
        # torchrun died before prctl took effect (even before `parent` was read: this process was
        # handed to init or a subreaper): an orphan must not go on into DIR. The random-kill harness
        # caught one (a kill of the supervisor's group while the workers were still importing).
        os._exit(ERROR)


def is_launcher(pid: int) -> bool:
    """Whether `pid` is a torch elastic launcher (torchrun, python -m torch.distributed.run)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return True  # cannot tell: trust the parent check above
    return b"torchrun" in command or b"torch.distributed.run" in command or b"torch.distributed.launch" in command
