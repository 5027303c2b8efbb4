"""When a failed event is tried again, and when it is given up as dead."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from outbox_core.message import Outcome, OutcomeKind


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff between attempts and the attempt budget.

    ``exponential``: ``base * multiplier ** (attempt - 1)``, capped at ``cap``,
    with the upper ``jitter`` fraction randomised so relays that failed
    together do not retry together. ``fixed``: always ``base`` (jittered).
    A broker's ``retry_after`` is a lower bound.
    """

    max_attempts: int = 10
    base: float = 1.0
    cap: float = 300.0
    multiplier: float = 2.0
    jitter: float = 0.5
    kind: Literal["exponential", "fixed"] = "exponential"

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.base < 0 or self.cap < 0 or self.multiplier < 1:
            raise ValueError("backoff base and cap must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be between 0 and 1")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if self.kind == "fixed":
            raw = self.base
        else:
            # Cap the exponent first: 2.0 ** 2000 overflows a float.
            exponent = min(max(attempt - 1, 0), 64)
            raw = min(self.cap, self.base * self.multiplier**exponent)
        spread = raw * self.jitter
        return raw - spread + (rng or random).random() * spread

    def next_try(
        self, attempt: int, outcome: Outcome, rng: random.Random | None = None
    ) -> float | None:
        """Seconds until the next try after ``outcome``, or ``None`` if the event is dead."""
        if outcome.kind is OutcomeKind.REJECT or attempt >= self.max_attempts:
            return None
        delay = self.backoff(attempt, rng)
        if outcome.retry_after is not None:
            delay = max(delay, outcome.retry_after)
        return delay


class Backoff:
    """The waits of a loop that retries: one :class:`RetryPolicy` schedule, jittered.

    ``next()`` is the wait after one more failure in a row (``base``, then
    doubling up to ``cap``, the upper ``jitter`` fraction randomised so that
    threads and relays that failed together do not retry together);
    ``reset()`` starts over after a success. Not thread-safe: one per loop.
    """

    __slots__ = ("failures", "policy", "rng")

    def __init__(
        self, base: float, cap: float, *, jitter: float = 0.5, rng: random.Random | None = None
    ) -> None:
        self.policy = RetryPolicy(base=base, cap=cap, jitter=jitter)
        self.rng = rng
        #: Failures in a row since the last :meth:`reset`.
        self.failures = 0

    def next(self) -> float:
        """Seconds to wait after one more failure in a row."""
        self.failures += 1
        return self.policy.backoff(self.failures, self.rng)

    def reset(self) -> None:
        """A success: the next failure waits ``base`` again."""
        self.failures = 0
