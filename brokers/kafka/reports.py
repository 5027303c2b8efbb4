"""What librdkafka reports: each record's delivery, its log lines, and what its codes mean.

:class:`DeliveryReports` collects a batch's delivery callbacks;
:class:`ClientLog` routes librdkafka's log lines into Python logging, masked;
:data:`REJECTED`, :data:`PURGED` and :func:`every_broker_down` are the codes
and texts the broker decides an outcome by.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Final

from confluent_kafka import KafkaError

from outbox_core.brokers.kafka.options import mask_secrets

#: librdkafka's own log lines (routed through Python logging, so they are masked).
client_log = logging.getLogger("outbox.brokers.kafka.librdkafka")

#: Errors of one record that no retry will cure.
REJECTED: Final = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,  # invalid topic
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.POLICY_VIOLATION,
        KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
        KafkaError._INVALID_ARG,
    }
)
#: Records the broker purged from librdkafka's queue (an outage, or close).
PURGED: Final = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
#: librdkafka's text of ``_ALL_BROKERS_DOWN``: "3/3 brokers are down".
_DOWN_COUNT: Final = re.compile(r"^(\d+)/(\d+) brokers are down")


def every_broker_down(text: str) -> bool:
    """librdkafka's ``_ALL_BROKERS_DOWN`` means it (it also says "0/4 brokers are down")."""
    match = _DOWN_COUNT.match(text)
    return match is None or 0 < int(match.group(1)) == int(match.group(2))


class ClientLog:
    """librdkafka's log lines into Python logging (where they are masked).

    A refused or lost connection is logged by librdkafka for every broker at
    every reconnect attempt; the broker's one outage line says it instead,
    so those lines go to DEBUG.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def log(self, level: int, msg: str, *args: Any) -> None:
        """librdkafka's ``logger.log`` call: one line, secrets masked."""
        if args and args[0] in ("FAIL", "PARTCNT"):
            level = logging.DEBUG
        if client_log.isEnabledFor(level):
            # librdkafka's debug output may quote a property: secrets are masked.
            client_log.log(level, "%s", mask_secrets(msg % args if args else msg, self.config))


class DeliveryReports:
    """One batch's delivery reports as they come in."""

    __slots__ = ("delivered", "errors", "pending")

    def __init__(self, size: int) -> None:
        #: position -> librdkafka's error (None: delivered)
        self.errors: dict[int, KafkaError | None] = {}
        self.pending = 0
        self.delivered = 0

    def report(self, index: int, error: KafkaError | None, _message: Any) -> None:
        """librdkafka's delivery callback for the record at ``index``."""
        self.errors[index] = error
        self.pending -= 1
        if error is None:
            self.delivered += 1
