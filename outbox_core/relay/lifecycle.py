"""The end of a relay's life, shared by the polling and the log-tailing relay.

A relay is a context manager: leaving the ``with`` block closes it, and
closing it closes its broker, whose failure to close is logged, never raised
(the relay's own work is done by then).
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Self

from outbox_core.brokers.base import Broker

log = logging.getLogger("outbox.relay")


class ClosableRelay:
    """``with relay:`` closes it; :meth:`close_broker` for the relays' ``close``."""

    broker: Broker

    def close(self) -> None:
        """Release what the relay holds (each relay says what), its broker last."""
        self.close_broker()

    def close_broker(self) -> None:
        """Close the broker; a failure is logged (nothing is left to publish)."""
        try:
            self.broker.close()
        except Exception:
            log.exception("closing the broker failed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
