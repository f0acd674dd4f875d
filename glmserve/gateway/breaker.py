"""A circuit breaker per backend: closed (traffic flows), open (no traffic for a cool-down), half-open (one trial
request decides). Passive ejection is the breaker opening: `failures` consecutive connect errors or 5xx
answers, each within `window_s` of the previous one, open it (the pattern of Nygard, "Release It!", ch. 5, and
Envoy's outlier detection `consecutive_5xx`)."""

from __future__ import annotations

import enum
import time


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failures: int = 3, window_s: float = 2.0, cooldown_s: float = 5.0,
                 clock=time.monotonic) -> None:
        self.failures = failures
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._streak = 0
        self._last_failure = -float("inf")
        self._opened_at = 0.0
        self._trial_out = False  # half-open: the one trial request is in flight
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_out = False
        return self._state

    def can_pass(self) -> bool:
        """Whether a request may be sent now (does not take the half-open trial slot)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_out)

    def acquire(self) -> None:
        """Marks a request as sent: in half-open it is the trial, and no other passes until it ends."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_out = True

    def on_success(self) -> None:
        self._streak = 0
        self._state = BreakerState.CLOSED
        self._trial_out = False

    def on_failure(self) -> None:
        now = self._clock()
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        self._streak = self._streak + 1 if now - self._last_failure <= self.window_s else 1
        self._last_failure = now
        if state is BreakerState.CLOSED and self._streak >= self.failures:
            self._open(now)

    def on_release(self) -> None:
        """A request ended with neither a verdict (a client disconnect, a 4xx): the trial slot frees."""
        self._trial_out = False

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._streak = 0
        self._trial_out = False
        self.times_opened += 1
