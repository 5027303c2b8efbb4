"""Interop with the reference libraries, both ways, on what the relay really sends.

* ``standardwebhooks`` (the Standard Webhooks reference library) verifies the
  signatures of requests the webhook broker sent to a real HTTP server, and
  :func:`outbox_core.brokers.signing.verify_signature` accepts what the library signs, including
  with a secret written without base64 padding.
* the CNCF ``cloudevents`` SDK parses the structured (HTTP and AMQP) and
  binary (AMQP) messages the brokers published (through the real RabbitMQ),
  and :func:`outbox_core.brokers.cloudevents.from_amqp_binary` reads what the SDK writes.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from datetime import UTC, datetime

import pytest
import standardwebhooks
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent

from outbox_core.brokers import cloudevents
from outbox_core.brokers.signing import WebhookVerificationError, decode_secret, verify_signature
from outbox_core.brokers.webhook import WebhookBroker
from outbox_core.message import Event, OutcomeKind
from tests.contract.broker_fixtures import SECRET, RabbitState, WebhookServer

NOW = datetime(2024, 5, 1, 12, 30, 15, 250000, tzinfo=UTC)


def make_event(topic: str = "contract.order.created", key: str | None = "order-1") -> Event:
    import uuid

    return Event(
        id=1,
        event_id=str(uuid.uuid4()),
        topic=topic,
        key=key,
        payload={"order_id": 7, "note": "café ☕"},
        headers={},
        attempts=1,
        created_at=NOW,
        token="t",
    )


@pytest.fixture
def webhook() -> WebhookServer:
    server = WebhookServer().start()
    yield server  # type: ignore[misc]
    server.stop()


# -- Standard Webhooks ----------------------------------------------------------------


def test_the_reference_library_verifies_what_the_relay_sent(webhook: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook.url, secret=SECRET)
    events = [make_event() for _ in range(3)]
    outcomes = broker.publish(events)
    broker.close()
    assert [o.kind for o in outcomes] == [OutcomeKind.OK] * 3
    reference = standardwebhooks.Webhook(SECRET)
    ids = {e.event_id for e in events}
    for received in webhook.requests:
        body = reference.verify(received.body, received.headers)  # raises unless valid
        assert body["id"] in ids and body["payload"] == events[0].payload
    # ...and it refuses a tampered body, so the check above means something.
    received = webhook.requests[0]
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        reference.verify(received.body + b" ", received.headers)


def test_our_verify_accepts_what_the_reference_library_signs() -> None:
    reference = standardwebhooks.Webhook(SECRET)
    body = json.dumps({"order_id": 7, "note": "café"})
    now = datetime.now(UTC)
    signature = reference.sign("msg_1", now, body)
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    verify_signature(SECRET, headers, body.encode())
    with pytest.raises(WebhookVerificationError):
        verify_signature(SECRET, headers, body.encode() + b"x")


def test_a_secret_without_base64_padding_is_accepted_like_the_reference_library() -> None:
    key = b"sixteen byte key"  # 16 bytes: base64 ends in "=="
    unpadded = "whsec_" + base64.b64encode(key).decode().rstrip("=")
    assert decode_secret(unpadded) == key
    reference = standardwebhooks.Webhook(unpadded)
    now = datetime.now(UTC)
    headers = {
        "webhook-id": "msg_2",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": reference.sign("msg_2", now, "{}"),
    }
    verify_signature(unpadded, headers, b"{}")
    WebhookBroker.from_url("http://127.0.0.1:9/hook", secret=unpadded).close()


def test_receiver_side_verify_imports_without_httpx() -> None:
    code = (
        "import sys; sys.modules['httpx'] = None\n"  # import httpx now raises ImportError
        "from outbox_core.brokers.signing import verify_signature, sign\n"
        "import time; ts = int(time.time())\n"
        f"verify_signature({SECRET!r}, {{'webhook-id': 'm', 'webhook-timestamp': str(ts),"
        f" 'webhook-signature': sign({SECRET!r}, 'm', ts, b'{{}}')}}, b'{{}}')\n"
        "assert 'httpx' not in sys.modules or sys.modules['httpx'] is None\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- CloudEvents ----------------------------------------------------------------------


def _same_event(parsed: CloudEvent, event: Event, source: str = "outbox") -> None:
    assert parsed.get_id() == event.event_id
    assert parsed.get_type() == event.topic
    assert parsed.get_source() == source
    assert parsed.get_subject() == event.key
    assert parsed.get_time() == NOW
    assert parsed.get_data() == event.payload


def test_the_sdk_parses_the_webhooks_structured_cloudevents(webhook: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook.url, secret=SECRET, envelope="cloudevents")
    event = make_event()
    assert [o.kind for o in broker.publish([event])] == [OutcomeKind.OK]
    broker.close()
    [received] = webhook.requests
    message = ce_http.HTTPMessage(headers=received.headers, body=received.body)
    _same_event(ce_http.from_http_event(message), event)


@pytest.mark.needs_server
@pytest.mark.parametrize("prefix", ["cloudEvents_", "cloudEvents:"])
def test_the_sdk_parses_the_relays_binary_amqp_cloudevents(
    rabbit: RabbitState, prefix: str
) -> None:
    broker = rabbit.broker(envelope="cloudevents-binary", cloudevents_prefix=prefix)
    event = make_event()
    assert [o.kind for o in broker.publish([event])] == [OutcomeKind.OK]
    broker.close()
    [(properties, body)] = rabbit.drain()
    message = ce_amqp.AMQPMessage(
        properties={"content-type": properties.content_type},
        application_properties=dict(properties.headers),
        application_data=body,
    )
    _same_event(ce_amqp.from_binary_event(message), event)


@pytest.mark.needs_server
def test_the_sdk_parses_the_relays_structured_amqp_cloudevents(rabbit: RabbitState) -> None:
    broker = rabbit.broker(envelope="cloudevents")
    event = make_event()
    assert [o.kind for o in broker.publish([event])] == [OutcomeKind.OK]
    broker.close()
    [(properties, body)] = rabbit.drain()
    message = ce_amqp.AMQPMessage(
        properties={"content-type": properties.content_type},
        application_properties=dict(properties.headers or {}),
        application_data=body,
    )
    _same_event(ce_amqp.from_amqp_event(message), event)


def test_we_read_the_binary_amqp_cloudevents_the_sdk_writes() -> None:
    sdk_event = CloudEvent(
        {
            "id": "evt-1",
            "source": "/shop/orders",
            "type": "order.created",
            "specversion": "1.0",
            "subject": "order-1",
            "time": NOW,
            "datacontenttype": "application/json",
        },
        {"order_id": 7},
    )
    message = ce_amqp.to_binary_event(sdk_event)
    assert any(name.startswith("cloudEvents_") for name in message.application_properties)
    ours = cloudevents.from_amqp_binary(
        message.application_properties,
        message.properties.get("content-type"),
        message.application_data,
    )
    assert ours["id"] == "evt-1"
    assert ours["source"] == "/shop/orders"
    assert ours["type"] == "order.created"
    assert ours["subject"] == "order-1"
    assert ours["data"] == {"order_id": 7}
