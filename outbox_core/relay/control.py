"""Stop and wake-up requests to the threads of one relay.

Every loop of a relay (claiming, settling, maintenance, heartbeats, LISTEN,
log tailing) sleeps on the same :class:`Control`: a stop ends every sleep at
once, and a wake-up (a notification, :meth:`Relay.wake`) ends the claim
loop's idle wait.
"""

from __future__ import annotations

import threading


class Control:
    """Stop and wake-up requests (thread-safe)."""

    def __init__(self) -> None:
        #: Set once a stop is requested; retries of a statement watch it too.
        self.stop_requested = threading.Event()
        self._wake = threading.Event()

    def stop(self) -> None:
        """Ask every loop to return (after the batch in flight)."""
        self.stop_requested.set()
        self._wake.set()

    def wake(self) -> None:
        """End the current idle wait: claim now instead of at the poll interval."""
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self.stop_requested.is_set()

    @property
    def woken(self) -> bool:
        """A wake-up is pending: the next idle wait returns at once."""
        return self._wake.is_set()

    def sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True when a stop was requested (at once, or meanwhile)."""
        return self.stop_requested.wait(seconds)

    def idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a wake-up or a stop; True when one came."""
        woke = self._wake.wait(seconds)
        self._wake.clear()
        return woke
