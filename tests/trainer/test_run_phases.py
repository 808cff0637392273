"""The trainer's run typed by phase: the vote read by field name, the environment read once, the LR
schedule re-applied through the scheduler's public state."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest

from skyspot.recipe import load_recipe
from skyspot.trainer import process_env
from skyspot.trainer.preemption import Pending
from skyspot.trainer.resume import apply_schedule
from skyspot.trainer.vote import BALLOT_FIELDS, Ballot, tally


def test_a_ballot_goes_out_and_comes_back_by_field_name():
    ballot = Ballot(
        loss=1.5,
        tokens=7.0,
        emergency=1.0,
        checkpoint=0.0,
        time_due=1.0,
        first_seen=10.0,
        deadline=40.0,
        signaled=0.0,
        need_s=2.5,
        clock=99.0,
    )
    numbers = ballot.encode()
    assert numbers == [getattr(ballot, name) for name in BALLOT_FIELDS]  # the wire order is the fields' order
    assert Ballot.decode(numbers) == ballot
    with pytest.raises(ValueError):
        Ballot.decode(numbers[:-1])  # a short row is an error, not a shifted vote
    seen = Ballot.of(0.5, 3, Pending(emergency=True, signaled=True, deadline=30.0), time_due=False, need_s=-1.0)
    assert (seen.emergency, seen.signaled, seen.deadline, seen.first_seen, seen.tokens) == (1.0, 1.0, 30.0, 0.0, 3.0)


def test_the_tally_is_the_same_rule_on_every_rank():
    zero = Ballot(
        loss=1.0,
        tokens=3.0,
        emergency=0.0,
        checkpoint=0.0,
        time_due=1.0,
        first_seen=0.0,
        deadline=0.0,
        signaled=0.0,
        need_s=4.0,
        clock=50.0,
    )
    other = dataclasses.replace(
        zero, loss=3.0, tokens=5.0, emergency=1.0, first_seen=12.0, deadline=30.0, time_due=0.0, need_s=6.0, clock=51.0
    )
    vote = tally([zero, other], seconds=0.25)
    assert (vote.loss, vote.tokens, vote.emergency, vote.checkpoint) == (2.0, 8, True, False)
    assert vote.time_due and vote.now == 50.0  # global rank 0's interval clock and its time
    assert (vote.first_seen, vote.deadline, vote.need_s) == (12.0, 30.0, 6.0)  # the earliest notice, the slowest node
    unmeasured = tally([zero, dataclasses.replace(other, need_s=-1.0)], seconds=0.0)
    assert unmeasured.need_s == 0.0  # a leader with nothing measured: no prediction at all


def test_the_environment_is_read_once_into_a_record_that_cannot_change(monkeypatch):
    monkeypatch.setenv("SKYSPOT_DIST_TIMEOUT_SECONDS", "42")
    env = process_env.read()
    monkeypatch.setenv("SKYSPOT_DIST_TIMEOUT_SECONDS", "7")
    assert env.dist_timeout.total_seconds() == 42.0  # a copy: later changes are not seen
    with pytest.raises(TypeError):
        env.environ["RANK"] = "3"  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.environ = {}  # type: ignore[misc]
    assert os.environ["SKYSPOT_DIST_TIMEOUT_SECONDS"] == "7"


def test_the_schedule_reapplied_on_resume_is_what_the_scheduler_reports_and_saves():
    import torch

    from skyspot.trainer.engine import lr_factor

    recipe = load_recipe("tiny", ["train.steps=10", "train.warmup_steps=2", "train.lr=0.01"])
    train = recipe.train
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor(train.warmup_steps, train.steps, train.min_lr_ratio)
    )
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    apply_schedule(SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer), recipe)
    expected = train.lr * lr_factor(train.warmup_steps, train.steps, train.min_lr_ratio)(4)
    assert scheduler.get_last_lr() == [expected] and optimizer.param_groups[0]["lr"] == expected
    assert scheduler.base_lrs == [train.lr] and scheduler.state_dict()["_last_lr"] == [expected]
    assert scheduler.last_epoch == 4  # the step count stays the checkpoint's
