"""Client-side rate limit of the operator's API calls: a token bucket, as client-go's (QPS and burst).

`reserve(now)` takes a token and says how long its caller must wait for it; the clock is the caller's
(monotonic seconds), so the rule tests without sleeping.
"""

from __future__ import annotations


class TokenBucket:
    """`qps` tokens a second, at most `burst` saved up; qps <= 0: no limit."""

    def __init__(self, qps: float, burst: int, now: float = 0.0):
        self.qps = qps
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._at = now

    def reserve(self, now: float) -> float:
        """Take one token: 0 when one is there, else the seconds until it will be (it is spoken for already,
        so callers that wait in turn are spaced 1/qps apart)."""
        if self.qps <= 0:
            return 0.0
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps
