"""Interop: clients the project does not use read what the relay published to NATS and Redis.

* NATS: ``nats.js`` (the NATS project's JavaScript client, run by ``node``
  from ``tests/contract/interop/nats_read.cjs``; installed with npm into a
  temporary folder, pinned) reads the stream: subject, ``Nats-Msg-Id``,
  ``Outbox-Key``, ``traceparent`` and the body.
* Redis: the ``redis-cli`` binary reads the entries with ``XRANGE``.
* CloudEvents: the CNCF ``cloudevents`` SDK parses NATS's binary mode (the
  NATS binding's ``ce-`` headers are the HTTP binding's) and structured mode.

``node``/``npm`` or ``redis-cli`` missing skips the test, and fails it under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.bindings import http as ce_http

from outbox_core import Outbox
from outbox_core.brokers.nats import NatsBroker
from outbox_core.brokers.redis import RedisBroker
from outbox_core.message import OutcomeKind
from tests.contract.broker_fixtures import TRACEPARENT, in_ci, make_event
from tests.contract.stream_fixtures import NatsStream, RedisStreams, require_nats, require_redis

pytestmark = pytest.mark.needs_server

NATS_JS = "nats@2.29.3"
READER = Path(__file__).parent / "interop" / "nats_read.cjs"


def _tool_missing(what: str) -> None:
    if in_ci():
        pytest.fail(f"{what} is missing; CI=true requires it", pytrace=False)
    pytest.skip(f"{what} is missing")


@pytest.fixture(scope="session")
def node_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with nats.js installed (npm, once per session)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        _tool_missing("node and npm")
    folder = tmp_path_factory.mktemp("nats-js")
    done = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(folder), NATS_JS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        _tool_missing(f"{NATS_JS} from npm ({done.stderr.strip()[-300:]})")
    return folder / "node_modules"


@pytest.fixture
def stream() -> Iterator[NatsStream]:
    state = NatsStream(require_nats())
    yield state
    state.cleanup()


@pytest.fixture
def streams() -> Iterator[RedisStreams]:
    state = RedisStreams(require_redis())
    yield state
    state.cleanup()


def relay_through(broker: Any, tmp_path: Path, topic: str) -> list[str]:
    """Enqueue two events in SQLite and let one relay cycle publish them through ``broker``."""
    outbox = Outbox(f"sqlite:///{tmp_path / 'outbox.db'}")
    outbox.install()
    try:
        with outbox.engine.begin() as conn:
            ids = [
                outbox.enqueue(
                    conn,
                    topic,
                    {"order": 7, "note": "café ☕"},
                    key="order-7",
                    headers={"traceparent": TRACEPARENT},
                ),
                outbox.enqueue(conn, topic, {"order": 8}),
            ]
        relay = outbox.relay(broker)
        try:
            assert relay.run_once().sent == 2
        finally:
            relay.close()
    finally:
        outbox.dispose()
    return ids


def test_nats_js_reads_what_the_relay_published(
    stream: NatsStream, node_modules: Path, tmp_path: Path
) -> None:
    topic = stream.subject("order.created")
    keyed, unkeyed = relay_through(stream.broker(), tmp_path, topic)
    done = subprocess.run(
        ["node", str(READER), stream.url, stream.name],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NODE_PATH": str(node_modules)},
    )
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)
    assert first["subject"] == topic
    assert first["headers"]["Nats-Msg-Id"] == [keyed]
    assert first["headers"]["Outbox-Key"] == ["order-7"]
    # The enqueued trace context, or the relay's producer span's when tracing is on.
    [traceparent] = first["headers"]["traceparent"]
    shape = r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}"
    assert traceparent == TRACEPARENT or re.fullmatch(shape, traceparent)
    assert first["headers"]["Content-Type"] == ["application/json"]
    assert json.loads(first["data"]) == {"order": 7, "note": "café ☕"}
    assert second["headers"]["Nats-Msg-Id"] == [unkeyed]
    assert "Outbox-Key" not in second["headers"]


def test_redis_cli_reads_what_the_relay_published(streams: RedisStreams, tmp_path: Path) -> None:
    cli = shutil.which("redis-cli")
    if cli is None:
        _tool_missing("redis-cli")
    key = streams.stream("orders")
    keyed, unkeyed = relay_through(RedisBroker.from_url(streams.url, stream=key), tmp_path, "o.c")
    url = streams.url
    done = subprocess.run(
        [cli, "-u", url, "--raw", "XRANGE", key, "-", "+"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # --raw: each entry is its id, then field and value lines.
    entries: list[dict[str, str]] = []
    for line in lines:
        if "-" in line and line.split("-")[0].isdigit() and line.replace("-", "").isdigit():
            entries.append({})
            pending: list[str] = []
            continue
        pending.append(line)
        if len(pending) == 2:
            entries[-1][pending[0]] = pending[1]
            pending = []
    first, second = entries
    assert first["event_id"] == keyed and first["topic"] == "o.c" and first["key"] == "order-7"
    assert json.loads(first["payload"]) == {"order": 7, "note": "café ☕"}
    assert set(json.loads(first["headers"])) == {"traceparent"}
    assert second["event_id"] == unkeyed and "key" not in second


@pytest.mark.parametrize("envelope", ["cloudevents", "cloudevents-binary"])
def test_the_cloudevents_sdk_parses_nats_messages(stream: NatsStream, envelope: str) -> None:
    event = make_event(stream.subject("order.created"), key="order-1", payload={"order_id": 7})
    broker = NatsBroker.from_url(stream.url, envelope=envelope, source="/billing")
    try:
        assert [o.kind for o in broker.publish([event])] == [OutcomeKind.OK]
    finally:
        broker.close()
    [msg] = stream.messages()
    # The NATS binding's headers (ce-*, Content-Type) are the HTTP binding's.
    message = ce_http.HTTPMessage(headers=dict(msg.headers or {}), body=msg.data or b"")
    parsed = ce_http.from_http_event(message)
    assert parsed.get_id() == event.event_id
    assert parsed.get_type() == event.topic
    assert parsed.get_source() == "/billing"
    assert parsed.get_subject() == "order-1"
    assert parsed.get_time() == datetime(2024, 5, 1, 12, 30, 15, 250000, tzinfo=UTC)
    assert parsed.get_data() == {"order_id": 7}
    assert parsed.get_extension("traceparent") == TRACEPARENT
