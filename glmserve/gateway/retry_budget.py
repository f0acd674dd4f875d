"""Retries capped as a share of traffic (the retry budget of Finagle's `RetryBudget` and Envoy's
`retry_budget`): over a sliding window, retries may not exceed `share` of the requests, plus a small floor
so that a quiet gateway can still retry a failed request. The window is a minute: a replica that dies holds
about its share of the gateway's concurrency in flight at once, and long generations make few requests per
second, so a 10 s window would refuse some of the retries that one death needs."""

from __future__ import annotations

import time
from collections import deque


class RetryBudget:
    def __init__(self, share: float, window_s: float = 60.0, floor: int = 3, clock=time.monotonic) -> None:
        self.share = share
        self.window_s = window_s
        self.floor = floor
        self._clock = clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _trim(self, now: float) -> None:
        for q in (self._requests, self._retries):
            while q and now - q[0] > self.window_s:
                q.popleft()

    def on_request(self) -> None:
        now = self._clock()
        self._requests.append(now)
        self._trim(now)

    def try_retry(self) -> bool:
        """Takes one retry from the budget if any is left."""
        now = self._clock()
        self._trim(now)
        if len(self._retries) >= self.floor + self.share * len(self._requests):
            return False
        self._retries.append(now)
        return True
