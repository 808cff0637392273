"""Training through a preemption notice's window: whether to hold on at each step boundary, and how
the window was spent (the emergency_checkpoint event's fields; docs/trainer.md).

Every rank decides on the vote's numbers (preemption.train_through), so all give the same answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from skyspot.trainer.durable import emergency_deadline
from skyspot.trainer.phases import EarlyCheckpoint, NoticeWindow
from skyspot.trainer.preemption import train_through as fits
from skyspot.trainer.say import say
from skyspot.trainer.vote import Vote

if TYPE_CHECKING:
    from skyspot.trainer.checkpoint import TrainState
    from skyspot.trainer.phases import Run


def train_through(run: Run, state: TrainState, vote: Vote) -> bool:
    """Every rank, after a vote with the emergency flag: keep training through the notice window?
    The same answer on every rank (preemption.train_through on the vote's numbers)."""
    progress, built = run.progress, run.trained
    if progress.notice is None:
        progress.notice = NoticeWindow(step=state.step, first_seen=vote.first_seen, deadline=vote.deadline)
    notice = progress.notice
    cfg = built.recipe.checkpoint
    upload_deadline = (
        emergency_deadline(vote.deadline, vote.first_seen, run.placement.where.get("cloud"))
        if vote.deadline is not None
        else None
    )
    eligible = (
        cfg.train_through_notice
        and not vote.signaled
        and upload_deadline is not None
        and (state.step > 0 or built.resumed is not None)
    )
    hold, early = False, notice.early
    if eligible and vote.need_s > 0:
        hold = fits(
            now=vote.now, need_s=vote.need_s, margin_s=cfg.notice_margin_seconds, upload_deadline=upload_deadline
        )
    elif eligible and early is None:
        # Nothing measured yet: checkpoint now (it secures the steps so far and measures the save), and
        # train on while it runs.
        notice.early = early = EarlyCheckpoint(step=state.step, at=vote.now)
        notice.checkpoint_now = True
        hold = vote.now + cfg.notice_margin_seconds < upload_deadline
    elif eligible:
        # Still nothing measured (the early checkpoint is still on its way): use at most half of what
        # was left of the window when it began, so an emergency save still has the other half.
        hold = vote.now < early.at + (upload_deadline - early.at) / 2
    notice.predicted_seconds = round(vote.need_s, 3) if vote.need_s > 0 else None
    if hold and notice.held == 0:
        run.emit(
            "notice_window",
            step=state.step,
            deadline=vote.deadline,
            upload_deadline=round(upload_deadline, 3),
            predicted_seconds=round(vote.need_s, 3) if vote.need_s > 0 else None,
            margin_seconds=cfg.notice_margin_seconds,
            early_checkpoint=early is not None,
            source=built.predictor.source if built.predictor is not None else None,
        )
        if run.placement.is_global_zero:
            said = (
                f"a save predicted at {vote.need_s:.1f} s"
                if vote.need_s > 0
                else "no save measured yet: a checkpoint now measures one"
            )
            say(
                f"preemption notice: training on through the window ({upload_deadline - vote.now:.0f} s to the "
                f"deadline, {said}); emergency checkpoint when it no longer fits"
            )
    if hold:
        notice.held += 1
    return hold


def window_fields(
    run: Run, step: int, vote: Vote, save_started: float, safe_at: float, durable: Optional[bool]
) -> dict[str, Any]:
    """How the notice window was spent (emergency_checkpoint fields; docs/trainer.md)."""
    notice = run.progress.notice
    notice_step = notice.step if notice is not None else None
    first = vote.first_seen
    window = (vote.deadline - first) if vote.deadline is not None and first else None
    return {
        "signaled": vote.signaled,
        "notice_step": notice_step,
        "steps_after_notice": (step - notice_step) if notice_step is not None else 0,
        "window_seconds": round(window, 3) if window is not None else None,
        "trained_after_notice_seconds": round(save_started - first, 3) if first else None,
        "notice_to_safe_seconds": round(safe_at - first, 3) if first else None,
        "slack_seconds": round(vote.deadline - safe_at, 3) if vote.deadline is not None else None,
        "predicted_seconds": notice.predicted_seconds if notice is not None else None,
        "save_to_safe_seconds": round(safe_at - save_started, 3) if durable or durable is None else None,
    }
