"""Polling instead of sleeping: wait until a condition holds, or fail saying what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait_for condition did not hold in time."""


def wait_for(
    condition: Callable[[], T],
    timeout: float = 30.0,
    *,
    interval: float = 0.1,
    what: str = "",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``condition`` until it returns a truthy value and return that value.

    Exceptions listed in ``ignore`` count as "not yet". On timeout raises WaitTimeout
    naming ``what`` (or the condition) and the last value or exception seen.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            name = what or getattr(condition, "__name__", repr(condition))
            raise WaitTimeout(f"timed out after {timeout:.1f}s waiting for {name}; last: {last!r}")
        time.sleep(interval)


def holds(condition: Callable[[], object], seconds: float, *, interval: float = 0.5, what: str = "") -> None:
    """``condition()`` is truthy now and at every ``interval`` for ``seconds``: something that must NOT
    happen (a retry, a second Event) did not happen in that time."""
    deadline = time.monotonic() + seconds
    while True:
        assert condition(), f"no longer holds: {what or getattr(condition, '__name__', repr(condition))}"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)
