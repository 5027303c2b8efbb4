"""SIGTERM / SIGINT for ``Relay.run()``: finish the batch in flight, then stop.

The first signal lets the batch in flight finish; a second one interrupts it
(``KeyboardInterrupt``), and the relay releases its unpublished claims.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger("outbox.relay")


class StopOnSignal:
    """The handler: the first signal calls ``stop``, the second interrupts."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self.stop = stop
        self.received = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler."""
        self.received += 1
        if self.received > 1:
            raise KeyboardInterrupt  # second signal: interrupt the batch in flight
        log.info("signal %d: finishing the batch in flight, then stopping", signum)
        self.stop()


@contextmanager
def stop_on_signals(stop: Callable[[], None], *, install: bool) -> Iterator[None]:
    """Handle SIGTERM and SIGINT while inside (main thread only); restore the old handlers."""
    previous: dict[signal.Signals, Any] = {}
    if install and threading.current_thread() is threading.main_thread():
        handler = StopOnSignal(stop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
