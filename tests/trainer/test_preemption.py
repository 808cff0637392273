"""Training through a notice window: the decision and the save-time prediction (preemption.py)."""

from __future__ import annotations

import signal

from skyspot.trainer.preemption import PreemptionWatch, SavePredictor, train_through


def test_training_goes_on_only_while_the_padded_prediction_and_margin_fit():
    # 100 s left: a 10 s need padded to 12.5 plus a 5 s margin fits; a need of 80 s does not.
    assert train_through(now=1000.0, need_s=10.0, margin_s=5.0, upload_deadline=1100.0)
    assert not train_through(now=1000.0, need_s=80.0, margin_s=5.0, upload_deadline=1100.0)
    # Exactly at the edge (75 x 1.25 + 6.25 = 100) is no longer "before".
    assert not train_through(now=1000.0, need_s=75.0, margin_s=6.25, upload_deadline=1100.0)


def test_without_a_measurement_or_a_deadline_the_save_comes_at_once():
    assert not train_through(now=0.0, need_s=0.0, margin_s=0.0, upload_deadline=1e9)
    assert not train_through(now=0.0, need_s=float("nan"), margin_s=0.0, upload_deadline=1e9)
    assert not train_through(now=0.0, need_s=1.0, margin_s=0.0, upload_deadline=None)


def test_the_prediction_is_the_slowest_recent_measurement_to_safety():
    local = SavePredictor(store=False)
    assert local.predict() is None
    local.observe_commit(0.5, 2.0)
    local.observe_commit(0.25, 1.0)
    assert local.predict() == 2.5
    for _ in range(SavePredictor.KEEP):  # only the last few count: a slow start does not stick
        local.observe_commit(0.1, 0.4)
    assert local.predict() == 0.5

    durable = SavePredictor(store=True)
    durable.observe_commit(0.1, 0.4)
    assert durable.predict() is None  # with a store, only a durable copy counts
    durable.started(8, 1000.0)
    durable.observe_durable(8, 1007.5)
    durable.observe_durable(9, 2000.0)  # a step whose start it never saw is ignored
    assert durable.predict() == 7.5 and durable.source == "measured"


def test_earlier_attempts_seed_the_prediction_from_their_events():
    events = [
        {"ts": 100.0, "attempt": 1, "type": "checkpoint_begin", "step": 4},
        {"ts": 100.5, "attempt": 1, "type": "checkpoint_end", "step": 4, "blocked_seconds": 0.2, "write_seconds": 0.3},
        {"ts": 104.0, "attempt": 1, "type": "upload_end", "step": 4, "bytes": 10, "durable": True, "error": None},
        {"ts": 109.0, "attempt": 1, "type": "upload_end", "step": 4, "bytes": 10, "durable": True, "error": None},
        {"ts": 120.0, "attempt": 1, "type": "upload_end", "step": 8, "bytes": 0, "error": "superseded by step 9"},
    ]
    durable = SavePredictor(store=True)
    durable.seed(events)
    assert durable.predict() == 9.0 and durable.source == "earlier attempts"  # the slower node's part
    local = SavePredictor(store=False)
    local.seed(events)
    assert local.predict() == 0.5


def test_a_signal_is_remembered_apart_from_a_notice():
    watch = PreemptionWatch()
    watch.request_emergency(deadline=2000.0, source="aws")
    pending = watch.take()
    assert pending.emergency and not pending.signaled and pending.deadline == 2000.0
    watch._on_signal(signal.SIGTERM, None)
    assert watch.take().signaled and watch.take().signaled  # it stays set, like the emergency flag
