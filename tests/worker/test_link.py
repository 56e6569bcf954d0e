"""The link's retry policy (the link itself is tested against real servers in test_client.py,
test_lane.py and test_transports.py)."""

from __future__ import annotations

import pytest

from worker.link import RetryPolicy

# ---- retries ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "attempt", "base"),
    [
        (RetryPolicy(), 0, 0.05),
        (RetryPolicy(), 3, 0.4),
        (RetryPolicy(), 10, 2.0),  # capped
        (RetryPolicy(initial_backoff_s=1.0, max_backoff_s=1.5), 1, 1.5),
    ],
)
def test_backoff_doubles_up_to_its_cap_with_jitter_below_it(
    policy: RetryPolicy, attempt: int, base: float
) -> None:
    delays = [policy.delay_s(attempt) for _ in range(200)]
    assert all(base / 2 <= d <= base for d in delays)


def test_a_policy_needs_an_attempt() -> None:
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        RetryPolicy(attempts=0)
