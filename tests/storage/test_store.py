"""skyspot.storage.store: retrying what is worth retrying, with backoff and jitter."""

from __future__ import annotations

import pytest

from skyspot.errors import StoreError
from skyspot.storage import TransientStoreError, backoff_delay, with_retries


# --------------------------------------------------------------------------- retries


def test_with_retries_retries_transient_errors_then_succeeds():
    calls, retries, sleeps = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientStoreError("endpoint unreachable")
        return "ok"

    result = with_retries(
        flaky,
        attempts=5,
        base_delay=1.0,
        max_delay=1.5,
        on_retry=lambda n, e, d: retries.append((n, str(e))),
        sleep=sleeps.append,
    )
    assert result == "ok"
    assert retries == [(1, "endpoint unreachable"), (2, "endpoint unreachable")]
    assert 0.5 <= sleeps[0] <= 1.0 and 0.75 <= sleeps[1] <= 1.5  # equal jitter, capped at max_delay


def test_with_retries_gives_up_after_attempts_and_never_retries_permanent_errors():
    calls = []

    def down():
        calls.append(1)
        raise TransientStoreError("down")

    with pytest.raises(TransientStoreError):
        with_retries(down, attempts=3, base_delay=0, max_delay=0, sleep=lambda d: None)
    assert len(calls) == 3

    def denied():
        calls.append(1)
        raise StoreError("access denied")

    calls.clear()
    with pytest.raises(StoreError, match="access denied"):
        with_retries(denied, attempts=3, sleep=lambda d: None)
    assert len(calls) == 1


def test_backoff_grows_exponentially_up_to_the_cap():
    for attempt, cap in [(1, 1), (2, 2), (3, 4), (10, 30)]:
        delay = backoff_delay(attempt, base_delay=1, max_delay=30)
        assert cap / 2 <= delay <= cap
