"""A failed broker probe is one line: the client library's loggers are quieted (issue #21)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from outbox_core.brokers.base import Broker, probe_quietly
from outbox_core.message import Event, Outcome
from outbox_core.relay.breaker import Breaker


class NoisyBroker(Broker):
    """Logs like pika does on a refused connection, and says it is down."""

    quiet_loggers = ("noisy_client",)

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        return [Outcome.unavailable("down") for _ in events]

    def probe(self) -> str | None:
        for _ in range(7):
            logging.getLogger("noisy_client.adapters").error("Socket failed to connect")
        return "connecting failed: refused"


def test_probe_quietly_silences_the_client_loggers_and_restores_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger("noisy_client").setLevel(logging.INFO)
    assert probe_quietly(NoisyBroker()) == "connecting failed: refused"
    assert not [r for r in caplog.records if r.name.startswith("noisy_client")]
    assert logging.getLogger("noisy_client").level == logging.INFO  # restored
    logging.getLogger("noisy_client.adapters").error("outside a probe")
    assert [r.getMessage() for r in caplog.records] == ["outside a probe"]


def test_a_relay_that_finds_the_broker_down_at_start_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    breaker = Breaker(NoisyBroker(), observers=[])
    breaker.probe_at_start()
    assert not breaker.state.up and breaker.state.error == "connecting failed: refused"
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in errors] == ["outbox.relay"]
    assert "broker unavailable at start: connecting failed: refused" in errors[0].getMessage()
    assert not breaker.ready()  # waits for the backoff, as in an outage
