"""The operator's client-side rate limit (kubetrain.operator.runtime.ratelimit): a token bucket."""

from __future__ import annotations

import pytest

from kubetrain.operator.runtime.ratelimit import TokenBucket


def test_a_burst_goes_at_once_and_the_calls_after_it_are_spaced_one_over_qps_apart():
    bucket = TokenBucket(qps=10, burst=3, now=0.0)
    waits = [bucket.reserve(0.0) for _ in range(6)]
    assert waits == pytest.approx([0, 0, 0, 0.1, 0.2, 0.3])


def test_tokens_come_back_at_qps_up_to_the_burst():
    bucket = TokenBucket(qps=10, burst=3, now=0.0)
    for _ in range(3):
        bucket.reserve(0.0)
    assert bucket.reserve(0.1) == pytest.approx(0.0)  # one came back
    assert bucket.reserve(0.1) == pytest.approx(0.1)
    idle = TokenBucket(qps=10, burst=3, now=0.0)
    assert [idle.reserve(100.0) for _ in range(4)] == pytest.approx([0, 0, 0, 0.1])  # saved up: the burst only


def test_qps_0_is_no_limit():
    bucket = TokenBucket(qps=0, burst=1)
    assert all(bucket.reserve(0.0) == 0 for _ in range(1000))
