"""The Redis Streams broker against the real server (``OUTBOX_TEST_REDIS_URL``, default loopback).

The broker contract of ``test_brokers`` runs here through a Redis harness
(the contract's tests are imported, so they collect with this module's
``harness``); then Redis's own rules: entry fields, the stream and maxlen
options, deduplication, WRONGTYPE and error mapping, and outages through a
TCP proxy. Only keys under the test's own prefix are written and deleted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import create_broker
from outbox_core.brokers.redis import DEDUP_PREFIX, RedisBroker, RedisOptions, classify_error
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, OutcomeKind
from outbox_core.testing.broker_contract import *  # noqa: F403  (the contract's tests)
from outbox_core.testing.broker_contract import DOWN, OK, REJECT, RETRY, Harness, kinds
from tests.contract.broker_fixtures import TRACEPARENT, TcpProxy, make_event, unused_port
from tests.contract.stream_fixtures import RedisStreams, require_redis


@pytest.fixture
def streams() -> Iterator[RedisStreams]:
    """Stream keys of the test's own (fails under CI=true when Redis is down)."""
    state = RedisStreams(require_redis())
    yield state
    state.cleanup()


class _UnderPrefix(RedisBroker):
    """The contract's topics (``contract.*``) as stream keys under the test's prefix."""

    prefix = ""

    def stream_key(self, event: Event) -> str:
        key = super().stream_key(event)
        return f"{self.prefix}.{key}" if key.startswith("contract.") else key


@pytest.fixture
def harness(streams: RedisStreams) -> Iterator[Harness]:
    broker = _UnderPrefix.from_url(streams.url)
    assert isinstance(broker, _UnderPrefix)
    broker.prefix = streams.prefix
    wrong = streams.stream("a-string")
    streams.client.set(wrong, "x")

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        if kind != "reject":
            pytest.skip("Redis has no switch for a transient failure of one entry")
        return make_event(wrong, key=event.key)  # WRONGTYPE

    h = Harness(
        "redis",
        broker,
        streams.arrived,
        fail,
        down=lambda: RedisBroker.from_url(
            f"redis://:s3cret@127.0.0.1:{unused_port()}/0", connect_timeout=2
        ),
        can_retry=False,
    )
    yield h
    h.broker.close()


pytestmark = pytest.mark.needs_server


def test_entry_fields(streams: RedisStreams) -> None:
    broker = streams.broker()
    keyed = make_event(
        streams.stream("order.created"),
        key="order-7 ✓",
        attempts=3,
        payload={"note": "café ☕ 😀", "quote": '"\\'},  # non-ASCII, astral, escapes
    )
    unkeyed = make_event(streams.stream("order.created"), headers={})
    try:
        assert kinds(broker.publish([keyed, unkeyed])) == [OK, OK]
    finally:
        broker.close()
    (_, first), (_, second) = streams.entries(keyed.topic)
    assert first == {
        b"event_id": keyed.event_id.encode(),
        b"topic": keyed.topic.encode(),
        b"key": "order-7 ✓".encode(),
        b"payload": json.dumps(keyed.payload, separators=(",", ":"), ensure_ascii=False).encode(),
        b"headers": json.dumps(
            {"traceparent": TRACEPARENT, "x-test": "1"}, separators=(",", ":")
        ).encode(),
    }
    assert second[b"event_id"] == unkeyed.event_id.encode()
    assert b"key" not in second  # no key, no field
    assert json.loads(second[b"headers"]) == {}


def test_stream_option_fixes_the_stream_key(streams: RedisStreams) -> None:
    fixed = streams.stream("all-events")
    broker = streams.broker(stream=fixed)
    events = [make_event(f"orders.e{i}") for i in range(3)]
    try:
        assert kinds(broker.publish(events)) == [OK] * 3
    finally:
        broker.close()
    assert [f[b"topic"] for _, f in streams.entries(fixed)] == [e.topic.encode() for e in events]
    assert streams.keys() == [fixed.encode()]


def test_maxlen_trims_approximately(streams: RedisStreams) -> None:
    broker = streams.broker(maxlen="100")
    topic = streams.stream("trimmed")
    published: list[str] = []
    try:
        for _ in range(10):
            batch = [make_event(topic) for _ in range(100)]
            published += [DEDUP_PREFIX + e.event_id for e in batch]
            assert kinds(broker.publish(batch)) == [OK] * 100
    finally:
        broker.close()
        streams.client.delete(*published)  # trimmed entries' ids: cleanup cannot see them
    length = streams.client.xlen(topic)
    assert 100 <= length < 1000  # "~": whole macro nodes are trimmed, never below maxlen


def test_cloudevents_envelope(streams: RedisStreams) -> None:
    broker = streams.broker(envelope="cloudevents", source="/billing")
    event = make_event(streams.stream(), key="k1")
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [(_, fields)] = streams.entries(event.topic)
    assert json.loads(fields[b"payload"]) == cloudevents.structured(event, "/billing")


def test_republished_batch_adds_no_second_entry(streams: RedisStreams) -> None:
    """A relay that died after publishing re-publishes the batch: no entry is doubled."""
    broker = streams.broker()
    topic = streams.stream()
    events = [make_event(topic, key=f"k{i % 5}") for i in range(200)]
    try:
        assert kinds(broker.publish(events)) == [OK] * 200
        assert kinds(broker.publish([*events[50:], make_event(topic)])) == [OK] * 151
    finally:
        broker.close()
    held = [f[b"event_id"].decode() for _, f in streams.entries(topic)]
    assert held[:200] == [e.event_id for e in events]
    assert len(held) == 201
    ttl = streams.client.ttl(DEDUP_PREFIX + events[0].event_id)
    assert 3500 < ttl <= 3600  # dedup_ttl's default: an hour


def test_dedup_ttl_option_and_zero_turns_it_off(streams: RedisStreams) -> None:
    topic = streams.stream()
    short = streams.broker(dedup_ttl="90s")
    event = make_event(topic)
    try:
        assert kinds(short.publish([event, event])) == [OK, OK]  # the same id twice: one entry
        assert 0 < streams.client.ttl(DEDUP_PREFIX + event.event_id) <= 90
    finally:
        short.close()
    assert len(streams.entries(topic)) == 1
    off = streams.broker(dedup_ttl="0")
    other = make_event(topic)
    try:
        assert kinds(off.publish([other, other])) == [OK, OK]
    finally:
        off.close()
    assert len(streams.entries(topic)) == 3
    assert not streams.client.exists(DEDUP_PREFIX + other.event_id)


def test_wrongtype_is_a_reject_naming_the_stream_alone_in_its_batch(
    streams: RedisStreams,
) -> None:
    wrong = streams.stream("a-string")
    streams.client.set(wrong, "x")
    broker = streams.broker()
    bad, fine = make_event(wrong), make_event(streams.stream())
    try:
        outcomes = broker.publish([bad, fine])
        # Not remembered as seen: once the key is fixed, the event goes through.
        streams.client.delete(wrong)
        assert kinds(broker.publish([bad])) == [OK]
    finally:
        broker.close()
    assert kinds(outcomes) == [REJECT, OK]
    assert f"for stream {wrong!r}: WRONGTYPE" in (outcomes[0].error or "")


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ("OOM command not allowed when used memory > 'maxmemory'.", RETRY),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", REJECT),
        ("NOPERM this user has no permissions to access the 'orders' key", REJECT),
        ("READONLY You can't write against a read only replica.", DOWN),
        ("LOADING Redis is loading the dataset in memory", DOWN),
        ("BUSY Redis is busy running a script.", DOWN),
        ("ERR something else", RETRY),
    ],
)
def test_error_answers_map_to_outcomes(answer: str, kind: OutcomeKind) -> None:
    assert classify_error(answer).kind is kind


def test_oom_from_a_real_server_is_retry(tmp_path: Any) -> None:
    """A private redis-server with a tiny maxmemory (the shared one is never reconfigured)."""
    import shutil
    import subprocess

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server binary to start a private server")
    port = unused_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--save", "", "--appendonly", "no",
         "--maxmemory", "1mb", "--maxmemory-policy", "noeviction", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        broker = RedisBroker.from_url(f"redis://127.0.0.1:{port}/0")
        try:
            big = {"blob": "x" * 100_000}
            outcomes = []
            for _ in range(30):
                outcomes = list(broker.publish([make_event("oom.test", payload=big)]))
                if outcomes[0].kind is not OK:
                    break
        finally:
            broker.close()
        assert kinds(outcomes) == [RETRY]
        assert "OOM" in (outcomes[0].error or "")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------------
# Outages through a TCP proxy


@pytest.fixture
def proxy(streams: RedisStreams) -> Iterator[TcpProxy]:
    parts = urlsplit(streams.url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    yield proxy
    proxy.close()


def test_timeout_is_unavailable_and_the_republish_is_deduplicated(
    streams: RedisStreams, proxy: TcpProxy
) -> None:
    broker = streams.broker(proxy.url(streams.url), timeout="500ms")
    topic = streams.stream()
    events = [make_event(topic) for _ in range(20)]
    try:
        assert broker.probe() is None
        proxy.swallow_replies = True  # the script runs, its answer never comes
        started = time.monotonic()
        outcomes = broker.publish(events)
        assert time.monotonic() - started < 5
        assert kinds(outcomes) == [DOWN] * 20
        proxy.swallow_replies = False
        proxy.cut()
        assert kinds(broker.publish(events)) == [OK] * 20
    finally:
        broker.close()
    assert len(streams.entries(topic)) == 20  # stored once, although published twice


def test_outage_then_resumption(streams: RedisStreams, proxy: TcpProxy) -> None:
    broker = streams.broker(proxy.url(streams.url), connect_timeout=2)
    topic = streams.stream()
    try:
        assert kinds(broker.publish([make_event(topic)])) == [OK]
        proxy.down()
        outcomes = broker.publish([make_event(topic) for _ in range(3)])
        assert kinds(outcomes) == [DOWN] * 3
        assert broker.probe()
        proxy.up()
        assert broker.probe() is None
        assert kinds(broker.publish([make_event(topic)])) == [OK]
    finally:
        broker.close()


# ---------------------------------------------------------------------------
# Options and URLs


def test_options_are_one_frozen_dataclass() -> None:
    broker = create_broker(
        "rediss://relay:s3cret@cache.example:6380/2",
        stream="events",
        maxlen="10000",
        dedup_ttl="10m",
        envelope="CloudEvents",
        source="/billing",
        timeout="2s",
        connect_timeout="1500ms",
        connection_name="billing-relay",
    )
    assert isinstance(broker, RedisBroker)
    assert broker.options == RedisOptions(
        stream="events",
        maxlen=10000,
        dedup_ttl=600.0,
        envelope="cloudevents",
        source="/billing",
        timeout=2.0,
        connect_timeout=1.5,
        connection_name="billing-relay",
    )
    kwargs = broker.client.connection_pool.connection_kwargs
    assert kwargs["db"] == 2 and kwargs["port"] == 6380 and kwargs["socket_timeout"] == 2.0
    assert broker.client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert "s3cret" not in repr(broker) and "s3cret" not in broker.display
    broker.close()


def test_connection_name_is_the_client_name(streams: RedisStreams) -> None:
    broker = streams.broker(connection_name="natsredis23-relay")
    try:
        assert broker.probe() is None
        assert broker.client.client_getname() == "natsredis23-relay"
    finally:
        broker.close()


@pytest.mark.parametrize(
    "options",
    [
        {"envelope": "cloudevents-binary"},
        {"maxlen": "lots"},
        {"dedup_ttl": "forever"},
        {"timeout": "0"},
        {"strem": "typo"},
        {"source": ""},
    ],
)
def test_bad_options_raise_configuration_error(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        create_broker("redis://127.0.0.1:6379/0", **options)


@pytest.mark.parametrize(
    "url", ["redis://u:s3cret@127.0.0.1:6379/notadb", "redis://u:s3cret@127.0.0.1:notaport/0"]
)
def test_bad_url_is_a_configuration_error_without_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_broker(url)
    assert "s3cret" not in str(caught.value)


def test_password_never_shown_when_down() -> None:
    broker = RedisBroker.from_url(f"redis://relay:s3cret@127.0.0.1:{unused_port()}/0")
    try:
        [outcome] = broker.publish([make_event()])
        problem = broker.probe()
    finally:
        broker.close()
    assert outcome.kind is DOWN
    for text in (repr(broker), outcome.error or "", problem or ""):
        assert "s3cret" not in text
