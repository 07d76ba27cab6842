"""A work queue of keys for a few asyncio workers, after client-go's workqueue.

- A key is queued at most once and handed to one worker at a time. A key added while a worker
  has it is handed out again once that worker is done: the newest state gets looked at.
- `add_after(key, delay)`: the key comes due later. Of several delays the earliest wins; an
  immediate `add` supersedes a pending delay (the work it triggers decides the next one), and a
  key already queued, or added again while a worker has it, ignores the delay.
- `forget(key)`: whatever is queued or due for a key that went away is dropped, and a worker
  busy with it does not requeue it.
- Keys are handed out only while leading (leader election); meanwhile they wait, deduplicated.
- Fair between groups (`fair_by(key)`: a job's namespace): `take` serves the groups with keys ready in
  turn, each group's keys in the order they came, so a namespace that queued 500 jobs delays another's
  one by a single reconcile, not by 500. Without `fair_by`, one group: first in, first out.
- `backoff(key)`: the delay before a failed key is tried again, doubling with each failure in a
  row (`retry_after` up to `max_retry_after`) until `reset(key)`; work that raised is retried so, or
  later when it raised RetryLater (the server said when: a 429's Retry-After).

The clock is injected (monotonic seconds) and read only by add_after and promote_due; `take`
and `done` are the synchronous halves of what a worker does, so the rules test without a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

log = logging.getLogger("kubetrain.operator")

K = TypeVar("K", bound=Hashable)


def _one_group(key: Hashable) -> None:
    """Every key in the same group: plain first in, first out."""


class RetryLater(Exception):
    """The work failed and its server said when to try again (seconds): not before that, nor before the
    backoff."""

    def __init__(self, after: float, why: str):
        super().__init__(why)
        self.after = after


class WorkQueue(Generic[K]):
    def __init__(self, clock: Callable[[], float] = time.monotonic, retry_after: float = 2.0,
                 max_retry_after: float = 60.0, fair_by: Callable[[K], Hashable] = _one_group):
        self._clock = clock
        self._group = fair_by
        self.retry_after = retry_after
        """Delay before a key that failed once is tried again."""
        self.max_retry_after = max_retry_after
        self._failures: dict[K, int] = {}
        """Failures in a row, per key, since its last reset()."""
        self._ready: dict[Hashable, deque[K]] = {}
        """Per group, its keys waiting for a worker, oldest first; only groups with keys waiting."""
        self._turns: deque[Hashable] = deque()
        """The groups in _ready, the one whose turn it is first."""
        self._queued: set[K] = set()
        """The keys in _ready."""
        self._active: set[K] = set()
        self._dirty: set[K] = set()
        """Active keys added again: queued once their worker is done."""
        self._dropped: set[K] = set()
        """Active keys forgotten: not requeued when their worker is done."""
        self._due: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        """(due, tie-breaker, key); entries no longer in _due are skipped (and compacted away)."""
        self._seq = itertools.count()
        self._leading = False
        self._work_ready = asyncio.Event()
        self._timers_changed = asyncio.Event()

    # ------------------------------------------------------------------ state

    def __len__(self) -> int:
        """Keys waiting for a worker (not those due later, nor those being worked on)."""
        return len(self._queued)

    def __contains__(self, key: object) -> bool:
        """Whether the queue holds anything for `key`: queued, due, or with a worker."""
        return key in self._queued or key in self._due or key in self._active

    def due_in(self, key: K) -> float | None:
        """Seconds until a delayed key comes due (None: no delay pending)."""
        at = self._due.get(key)
        return None if at is None else at - self._clock()

    @property
    def leading(self) -> bool:
        return self._leading

    def set_leading(self, leading: bool) -> None:
        """Hand keys out (True) or hold them back (False); a worker busy with one finishes it."""
        self._leading = leading
        if leading:
            self._work_ready.set()

    # ------------------------------------------------------------------ adding and forgetting

    def add(self, key: K) -> None:
        self._dropped.discard(key)
        self._cancel_delay(key)
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            group = self._group(key)
            if group not in self._ready:  # a group with nothing waiting joins at the end of the round
                self._ready[group] = deque()
                self._turns.append(group)
            self._ready[group].append(key)
            self._work_ready.set()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        if key in self._queued or key in self._dirty:  # it runs sooner anyway
            return
        at = self._clock() + delay
        if self._due.get(key, at + 1) <= at:  # an earlier one is pending: it wins
            return
        self._dropped.discard(key)
        self._due[key] = at
        heapq.heappush(self._heap, (at, next(self._seq), key))
        self._compact()
        self._timers_changed.set()

    def forget(self, key: K) -> None:
        self._cancel_delay(key)
        self._failures.pop(key, None)
        self._dirty.discard(key)
        if key in self._queued:
            self._queued.discard(key)
            group = self._group(key)
            self._ready[group].remove(key)
            if not self._ready[group]:
                del self._ready[group]
                self._turns.remove(group)
        if key in self._active:
            self._dropped.add(key)

    def _cancel_delay(self, key: K) -> None:
        if self._due.pop(key, None) is not None:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap once stale entries outnumber live ones, so replaced and forgotten delays
        (a deleted job's TTL, say) do not pile up until their time."""
        if len(self._heap) > 2 * len(self._due) + 16:
            self._heap = [e for e in self._heap if self._due.get(e[2]) == e[0]]
            heapq.heapify(self._heap)

    def promote_due(self) -> float | None:
        """Queue the keys whose delay is over; seconds until the next one is due (None: none pending)."""
        now = self._clock()
        while self._heap:
            at, _, key = self._heap[0]
            if self._due.get(key) == at:  # else replaced or forgotten: drop it
                if at > now:
                    return at - now
                del self._due[key]
                self.add(key)
            heapq.heappop(self._heap)
        return None

    # ------------------------------------------------------------------ failures

    def backoff(self, key: K) -> float:
        """One more failure of `key`: the delay before trying it again."""
        n = self._failures.get(key, 0)
        self._failures[key] = n + 1
        return min(self.retry_after * 2 ** min(n, 32), self.max_retry_after)

    def reset(self, key: K) -> None:
        """`key` succeeded: its next failure waits retry_after again."""
        self._failures.pop(key, None)

    # ------------------------------------------------------------------ workers

    def take(self) -> K | None:
        """The next key for a worker (now being worked on), or None: none queued, or not leading."""
        if not self._leading or not self._turns:
            return None
        group = self._turns.popleft()
        keys = self._ready[group]
        key = keys.popleft()
        if keys:  # the group's next key waits for the other groups' turns
            self._turns.append(group)
        else:
            del self._ready[group]
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: K, requeue_after: float | None) -> None:
        """A worker finished `key`: queue it again if it was added meanwhile, else after `requeue_after`."""
        self._active.discard(key)
        if key in self._dropped:
            self._dropped.discard(key)
        elif key in self._dirty:
            self._dirty.discard(key)
            self.add(key)
        elif requeue_after is not None:
            self.add_after(key, requeue_after)

    async def get(self) -> K:
        while (key := self.take()) is None:
            self._work_ready.clear()
            await self._work_ready.wait()
        return key

    async def serve(self, workers: int, handle: Callable[[K], Awaitable[float | None]]) -> None:
        """Run the timer and `workers` workers until cancelled. `handle(key)` does the work and returns
        when to look at the key again (None: only when it is added)."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._timer())
            for _ in range(workers):
                tasks.create_task(self._work(handle))

    async def _timer(self) -> None:
        while True:
            self._timers_changed.clear()  # before promote_due: a delay added after it wakes us
            wait = self.promote_due()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._timers_changed.wait(), wait)

    async def _work(self, handle: Callable[[K], Awaitable[float | None]]) -> None:
        while True:
            key = await self.get()
            requeue: float | None = None
            try:
                requeue = await handle(key)
            except RetryLater as exc:  # throttled: expected under load, no traceback
                requeue = max(self.backoff(key), exc.after)
                log.warning("work on %s: %s; retrying in %.0fs", key, exc, requeue)
            except Exception:  # one key's failure must not stop the worker: it is retried
                requeue = self.backoff(key)
                log.exception("work on %s failed; retrying in %.0fs", key, requeue)
            finally:
                self.done(key, requeue)
