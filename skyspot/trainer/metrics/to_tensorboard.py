"""TensorBoard: one log directory per run, `DIR/tensorboard/`, kept in the store as `<run>/tensorboard/`.

torch's SummaryWriter writes one event file per start into the same directory; the uploader syncs
the directory with the event files (uploader.sync_also) and a fresh node pulls it first, so
`tensorboard --logdir` over the store (a mount or a copy) shows the whole run as one. A start that
resumed from step N opens its writer with `purge_step=N+1`: TensorBoard's readers then drop what the
earlier files hold after N (the steps a rollback redoes), and the redone steps are drawn once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

DIR = "tensorboard"


class TensorBoard:
    name = "tensorboard"
    store_key = DIR

    def __init__(self, run_dir: Path, settings=None):
        self.dir = Path(run_dir) / DIR
        self.writer = None
        self.resumed_from = 0
        self._written: dict[str, int] = {}
        self._before: Optional[dict[str, set[int]]] = None  # earlier files' steps per tag, read only if asked

    def kept_dir(self) -> Path:
        return self.dir

    def open(self, ctx) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.resumed_from = ctx.resumed_from
        self.dir.mkdir(parents=True, exist_ok=True)
        # purge_step: a SessionLog.START at N+1 tells every reader to forget the earlier files' points
        # from N+1 on (a fresh start purges from step 1: a run directory reused after --fresh).
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=ctx.resumed_from + 1, flush_secs=10)

    def describe(self) -> str:
        return f"tensorboard ({self.dir})"

    def has(self, tag: str, step: int) -> bool:
        if step <= self._written.get(tag, -1):
            return True
        if step > self.resumed_from:
            return False  # purged from the earlier files, if they had it
        if self._before is None:  # a point at or before the resume point: an evaluation redone there
            self.writer.flush()
            self._before = read_scalars(self.dir)
        return step in self._before.get(tag, set())

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
            self._written[tag] = step

    def where(self, step: int, text: str, where: Mapping[str, Any]) -> None:
        self.writer.add_text("spot/where", text, global_step=step)

    def flush(self) -> None:
        self.writer.flush()  # a SIGKILL loses nothing flushed; the uploader sends what is on disk

    def close(self, kind: str) -> None:
        self.writer.close()


def read_scalars(directory: Path) -> dict[str, set[int]]:
    """The steps each scalar tag has in `directory`'s event files (TensorBoard's own reader, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, SCALARS

    acc = EventAccumulator(str(directory), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: {e.step for e in acc.Scalars(tag)} for tag in acc.Tags().get("scalars", [])}
