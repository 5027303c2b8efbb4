"""A broker connection that keeps failing: when to try again, and why it failed.

After a failed attempt the next one waits a backoff (0.5 s, doubling up to the
broker's ``reconnect_max``); a publish inside that wait is refused at once
with the last error, so a relay in an outage does not hammer the server. The
first failure of an outage is a warning, the rest debug: the relay logs the
outage itself, once. A probe connects at once (:meth:`Reconnects.now`): the
relay paces its probes.
"""

from __future__ import annotations

import logging
import time

from outbox_core.retry import Backoff


class Reconnects:
    """Failed connection attempts in a row, the next allowed one, the last error."""

    def __init__(self, name: str, cap: float, log: logging.Logger) -> None:
        #: The broker's name in messages: ``NATS``, ``RabbitMQ``.
        self.name = name
        self.log = log
        self.backoff = Backoff(0.5, cap)
        self.retry_at = 0.0
        self.last_error = ""

    @property
    def failures(self) -> int:
        """Failed attempts since the last success."""
        return self.backoff.failures

    def now(self) -> None:
        """Let the next attempt connect at once (a probe)."""
        self.retry_at = 0.0

    def waiting(self) -> str | None:
        """Why not to try yet (inside the backoff), or None."""
        wait = self.retry_at - time.monotonic()
        if wait <= 0:
            return None
        why = f"{self.name} unavailable ({self.last_error})"
        return f"{why}; next connection attempt in {wait:.1f}s"

    def failed(self, message: str) -> None:
        """One more failed attempt: schedule the next, log it (a warning once per outage)."""
        delay = self.backoff.next()
        self.retry_at = time.monotonic() + delay
        self.last_error = message
        self.log.log(
            logging.WARNING if self.failures == 1 else logging.DEBUG,
            "%s: %s (attempt %d; next attempt in %.1fs)",
            self.name,
            message,
            self.failures,
            delay,
        )

    def connected(self, display: str) -> None:
        """An attempt succeeded: the next failure starts a new outage."""
        if self.failures:
            self.log.info("%s: connected after %d failed attempts", display, self.failures)
        self.backoff.reset()
        self.retry_at = 0.0
