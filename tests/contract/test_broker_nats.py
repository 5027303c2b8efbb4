"""The NATS JetStream broker against the real server (``OUTBOX_TEST_NATS_URL``, default loopback).

The broker contract of ``test_brokers`` runs here through a NATS harness
(the contract's tests are imported, so they collect with this module's
``harness``); then NATS's own rules: headers and envelopes, deduplication by
``Nats-Msg-Id``, rejects, and outages through a TCP proxy.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import create_broker
from outbox_core.brokers.nats import NatsBroker, NatsMessage, NatsOptions, check_subject
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event
from outbox_core.testing.broker_contract import *  # noqa: F403  (the contract's tests)
from outbox_core.testing.broker_contract import DOWN, OK, REJECT, Harness, kinds
from tests.contract.broker_fixtures import TRACEPARENT, TcpProxy, make_event, unused_port
from tests.contract.stream_fixtures import NatsStream, require_nats

pytestmark = pytest.mark.needs_server


@pytest.fixture
def stream() -> Iterator[NatsStream]:
    """A JetStream stream of the test's own (fails under CI=true when NATS is down)."""
    state = NatsStream(require_nats(), duplicate_window=120)
    yield state
    state.cleanup()


class _UnderPrefix(NatsBroker):
    """The contract's topics (``contract.*``) under the test stream's subjects."""

    prefix = ""

    def build_message(self, event: Event) -> NatsMessage:
        message = super().build_message(event)
        if not message.subject.startswith("contract."):
            return message  # the harness's unbound subjects stay unbound
        return message._replace(subject=f"{self.prefix}.{message.subject}")


@pytest.fixture
def harness(stream: NatsStream) -> Iterator[Harness]:
    broker = _UnderPrefix.from_url(stream.url)
    assert isinstance(broker, _UnderPrefix)
    broker.prefix = stream.prefix

    def arrived() -> dict[str, tuple[str, dict[str, Any], Any]]:
        return {
            event_id: (subject.removeprefix(stream.prefix + "."), headers, payload)
            for event_id, (subject, headers, payload) in stream.arrived().items()
        }

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        if kind != "reject":
            pytest.skip("NATS has no switch for a transient failure of one message")
        return make_event(f"natsredis23.unbound.{uuid.uuid4().hex[:8]}", key=event.key)

    h = Harness(
        "nats",
        broker,
        arrived,
        fail,
        down=lambda: NatsBroker.from_url(f"nats://127.0.0.1:{unused_port()}", connect_timeout=2),
        can_retry=False,
    )
    yield h
    h.broker.close()


def test_messages_carry_msg_id_key_attempt_and_user_headers(stream: NatsStream) -> None:
    broker = stream.broker()
    keyed = make_event(stream.subject("order.created"), key="order-7", attempts=3)
    unkeyed = make_event(stream.subject("order.paid"), headers={})
    try:
        assert kinds(broker.publish([keyed, unkeyed])) == [OK, OK]
    finally:
        broker.close()
    first, second = stream.messages()
    assert first.subject == keyed.topic
    assert dict(first.headers or {}) == {
        "Nats-Msg-Id": keyed.event_id,
        "Outbox-Key": "order-7",
        "Outbox-Attempt": "3",
        "Content-Type": "application/json",
        "traceparent": TRACEPARENT,
        "x-test": "1",
    }
    assert json.loads(first.data or b"") == keyed.payload
    assert dict(second.headers or {}) == {
        "Nats-Msg-Id": unkeyed.event_id,
        "Outbox-Attempt": "1",
        "Content-Type": "application/json",
    }


def test_cloudevents_structured(stream: NatsStream) -> None:
    broker = stream.broker(envelope="cloudevents", source="/billing")
    event = make_event(stream.subject(), key="k1")
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [msg] = stream.messages()
    assert (msg.headers or {})["Content-Type"] == "application/cloudevents+json"
    assert json.loads(msg.data or b"") == cloudevents.structured(event, "/billing")


def test_cloudevents_binary_attributes_are_ce_headers(stream: NatsStream) -> None:
    broker = stream.broker(envelope="cloudevents-binary")
    event = make_event(stream.subject(), key="k1")
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [msg] = stream.messages()
    headers = dict(msg.headers or {})
    assert json.loads(msg.data or b"") == event.payload
    assert headers["Content-Type"] == "application/json"
    assert {k[3:]: v for k, v in headers.items() if k.startswith("ce-")} == {
        k: v for k, v in cloudevents.attributes(event).items() if k != "datacontenttype"
    }
    assert headers["ce-traceparent"] == TRACEPARENT


def test_republished_batch_is_one_copy_in_the_stream(stream: NatsStream) -> None:
    """A relay that died after publishing re-publishes the batch: JetStream drops the copies."""
    broker = stream.broker()
    events = [make_event(stream.subject(f"e{i % 3}"), key=f"k{i % 5}") for i in range(200)]
    try:
        assert kinds(broker.publish(events)) == [OK] * 200
        assert kinds(broker.publish(events)) == [OK] * 200  # PubAck duplicate=true is ok
    finally:
        broker.close()
    held = [dict(m.headers or {})["Nats-Msg-Id"] for m in stream.messages()]
    assert held == [e.event_id for e in events]


def test_no_stream_is_a_reject_naming_the_subject(stream: NatsStream) -> None:
    broker = stream.broker()
    lost = make_event(f"natsredis23.nostream.{uuid.uuid4().hex[:8]}")
    try:
        outcomes = broker.publish([lost, make_event(stream.subject())])
    finally:
        broker.close()
    assert kinds(outcomes) == [REJECT, OK]
    assert f"no JetStream stream is bound to subject {lost.topic!r}" in (outcomes[0].error or "")


@pytest.mark.parametrize(
    ("topic", "problem"),
    [
        ("orders created", "white space"),
        ("orders.*", "wildcard"),
        ("orders.>", "wildcard"),
        ("orders..created", "empty token"),
        (".orders", "empty token"),
        ("orders.", "empty token"),
    ],
)
def test_subject_rules_are_checked(topic: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_subject(topic)
    broker = NatsBroker.from_url("nats://127.0.0.1:1")
    try:
        [outcome] = broker.publish([make_event(topic)])  # rejected before connecting
    finally:
        broker.close()
    assert outcome.kind is DOWN or outcome.kind is REJECT
    check_subject("orders.created-v2.eu_west")


def test_bad_subject_rejected_alone_in_a_batch(stream: NatsStream) -> None:
    broker = stream.broker()
    try:
        outcomes = broker.publish([make_event("a b"), make_event(stream.subject())])
    finally:
        broker.close()
    assert kinds(outcomes) == [REJECT, OK]
    assert "is not a NATS subject" in (outcomes[0].error or "")


def test_over_max_payload_and_over_max_msg_size_are_rejected(stream: NatsStream) -> None:
    small = NatsStream(stream.url, max_msg_size=2000)
    broker = stream.broker()
    try:
        big = make_event(stream.subject(), payload={"blob": "x" * (2 << 20)})  # over 1 MB
        over = make_event(small.subject(), payload={"blob": "y" * 5000})
        fine = make_event(small.subject(), payload={"blob": "z"})
        outcomes = broker.publish([big, over, fine])
        assert kinds(outcomes) == [REJECT, REJECT, OK]
        assert "max_payload" in (outcomes[0].error or "")
        assert "JetStream refused the message" in (outcomes[1].error or "")
    finally:
        broker.close()
        small.cleanup()


def test_header_nats_cannot_carry_is_rejected(stream: NatsStream) -> None:
    broker = stream.broker()
    try:
        outcomes = broker.publish(
            [
                make_event(stream.subject(), headers={"bad name": "1"}),
                make_event(stream.subject(), headers={"x-ok": "line\r\nbreak"}),
                make_event(stream.subject()),
            ]
        )
    finally:
        broker.close()
    assert kinds(outcomes) == [REJECT, REJECT, OK]


# ---------------------------------------------------------------------------
# Outages through a TCP proxy


@pytest.fixture
def proxy(stream: NatsStream) -> Iterator[TcpProxy]:
    from urllib.parse import urlsplit

    parts = urlsplit(stream.url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 4222)
    yield proxy
    proxy.close()


def test_ack_timeout_is_unavailable_then_reconnects(stream: NatsStream, proxy: TcpProxy) -> None:
    broker = stream.broker(proxy.url(stream.url), ack_timeout="500ms")
    try:
        assert kinds(broker.publish([make_event(stream.subject())])) == [OK]
        proxy.swallow_replies = True
        started = time.monotonic()
        events = [make_event(stream.subject()) for _ in range(20)]
        outcomes = broker.publish(events)
        assert time.monotonic() - started < 5
        assert kinds(outcomes) == [DOWN] * 20
        assert "no PubAck from NATS within 0.5s" in (outcomes[0].error or "")
        proxy.swallow_replies = False
        # Re-published after the outage: the ones stored meanwhile are not doubled.
        assert kinds(broker.publish(events)) == [OK] * 20
        assert proxy.accepted == 2  # the stalled connection was replaced
    finally:
        broker.close()
    assert len(stream.messages()) == 21


def test_connection_lost_mid_batch_is_unavailable(stream: NatsStream, proxy: TcpProxy) -> None:
    broker = stream.broker(proxy.url(stream.url), ack_timeout=20)
    try:
        assert kinds(broker.publish([make_event(stream.subject())])) == [OK]
        proxy.swallow_replies = True
        threading.Timer(0.3, proxy.cut).start()
        started = time.monotonic()
        outcomes = broker.publish([make_event(stream.subject()) for _ in range(50)])
        assert time.monotonic() - started < 10  # not the 20s ack timeout
        assert kinds(outcomes) == [DOWN] * 50
        assert "connection lost" in (outcomes[0].error or "") or "closed" in (
            outcomes[0].error or ""
        )
        proxy.swallow_replies = False
        assert kinds(broker.publish([make_event(stream.subject()) for _ in range(5)])) == [OK] * 5
    finally:
        broker.close()


def test_connection_lost_while_idle_is_noticed_before_publishing(
    stream: NatsStream, proxy: TcpProxy
) -> None:
    broker = stream.broker(proxy.url(stream.url))
    try:
        assert kinds(broker.publish([make_event(stream.subject())])) == [OK]
        proxy.cut()
        time.sleep(0.3)
        assert kinds(broker.publish([make_event(stream.subject()) for _ in range(5)])) == [OK] * 5
        assert proxy.accepted == 2
    finally:
        broker.close()


def test_reconnect_backoff_while_down_and_probe(stream: NatsStream, proxy: TcpProxy) -> None:
    broker = stream.broker(proxy.url(stream.url), reconnect_max=1, connect_timeout=2)
    try:
        assert broker.probe() is None
        assert kinds(broker.publish([make_event(stream.subject())])) == [OK]
        proxy.down()
        lost = broker.publish([make_event(stream.subject())])  # the connection is gone
        failed = broker.publish([make_event(stream.subject())])  # connecting fails
        waiting = broker.publish([make_event(stream.subject())])  # inside the backoff
        assert kinds(lost + failed + waiting) == [DOWN] * 3
        assert "connecting to nats://127.0.0.1" in (failed[0].error or "")
        assert "next connection attempt" in (waiting[0].error or "")
        assert broker.probe()  # down: says why
        proxy.up()
        assert broker.probe() is None
        assert kinds(broker.publish([make_event(stream.subject())])) == [OK]
    finally:
        broker.close()


# ---------------------------------------------------------------------------
# Options and URLs


def test_options_are_one_frozen_dataclass(tmp_path: Any) -> None:
    creds = tmp_path / "relay.creds"
    creds.write_text("not used before connecting")
    broker = create_broker(
        "nats://127.0.0.1:4222",
        ack_timeout="2500ms",
        connect_timeout="3s",
        reconnect_max="5",
        envelope="CloudEvents",
        source="/billing",
        connection_name="billing relay",
        creds=str(creds),
        tls="yes",
    )
    assert isinstance(broker, NatsBroker)
    assert broker.options == NatsOptions(
        ack_timeout=2.5,
        connect_timeout=3.0,
        reconnect_max=5.0,
        envelope="cloudevents",
        source="/billing",
        connection_name="billing relay",
        creds=str(creds),
        tls=True,
    )
    broker.close()


@pytest.mark.parametrize(
    "options",
    [
        {"envelope": "xml"},
        {"ack_timeout": "0"},
        {"creds": "/no/such/file.creds"},
        {"tls_ca": "/no/such/ca.pem"},
        {"tls": "maybe"},
        {"ack_timout": "1"},
        {"source": "has space"},
    ],
)
def test_bad_options_raise_configuration_error(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        create_broker("nats://127.0.0.1:4222", **options)


@pytest.mark.parametrize("url", ["nats://u:s3cret@127.0.0.1:4222/extra", "nats://h:notaport"])
def test_bad_url_is_a_configuration_error_without_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_broker(url)
    assert "s3cret" not in str(caught.value)


def test_password_and_token_never_shown(stream: NatsStream) -> None:
    for url in (f"nats://relay:s3cret@127.0.0.1:{unused_port()}", "nats://s3cret@127.0.0.1:1"):
        broker = NatsBroker.from_url(url, connect_timeout=1)
        try:
            [outcome] = broker.publish([make_event(stream.subject())])
            problem = broker.probe()
        finally:
            broker.close()
        assert outcome.kind is DOWN
        for text in (repr(broker), broker.display, outcome.error or "", problem or ""):
            assert "s3cret" not in text


def test_tls_to_a_plain_server_is_unavailable(stream: NatsStream) -> None:
    """``tls=true`` or an ``ssl_context`` make the client insist on TLS: a plain server fails."""
    import ssl

    for options in ({"tls": "true"}, {"ssl_context": ssl.create_default_context()}):
        broker = stream.broker(connect_timeout=2, **options)
        try:
            [outcome] = broker.publish([make_event(stream.subject())])
        finally:
            broker.close()
        assert outcome.kind is DOWN, outcome
        assert "does not require TLS" in (outcome.error or "")
