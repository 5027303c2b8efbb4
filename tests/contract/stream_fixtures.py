"""Test doubles for the NATS JetStream and Redis Streams brokers: a stream of the test's own.

``NatsStream`` creates a JetStream stream with a unique name bound to
``<prefix>.>`` and deletes it afterwards; ``RedisStreams`` tracks the stream
keys and dedup keys a test wrote and deletes them (never FLUSHALL: the Redis
is shared). Both read back what really arrived, by event id. A server that is
down skips the test, or fails it under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import uuid
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.js.api
import pytest
import redis

from outbox_core.brokers.nats import NatsBroker
from outbox_core.brokers.redis import DEDUP_PREFIX, RedisBroker
from tests.contract.broker_fixtures import in_ci

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

_reachable: dict[str, str | None] = {}


def _require(service: str, url: str, check: Any) -> str:
    if url not in _reachable:
        try:
            check(url)
            _reachable[url] = None
        except Exception as exc:
            _reachable[url] = repr(exc)[:300]
    problem = _reachable[url]
    if problem is not None:
        message = (
            f"{service} at {urlsplit(url).netloc.rpartition('@')[2]} is unreachable ({problem})"
        )
        if in_ci():
            pytest.fail(f"{message}; CI=true requires it", pytrace=False)
        pytest.skip(message)
    return url


def require_tool(name: str) -> str:
    """The path of the program ``name``, or skip the test, or fail it under ``CI=true``."""
    found = shutil.which(name)
    if found is None:
        if in_ci():
            pytest.fail(f"{name} is not installed; CI=true requires it", pytrace=False)
        pytest.skip(f"{name} is not installed")
    return found


def nats_url() -> str:
    """The NATS under test: ``OUTBOX_TEST_NATS_URL`` or the local default."""
    return os.environ.get("OUTBOX_TEST_NATS_URL") or DEFAULT_NATS_URL


def redis_url() -> str:
    """The Redis under test: ``OUTBOX_TEST_REDIS_URL`` or the local default."""
    return os.environ.get("OUTBOX_TEST_REDIS_URL") or DEFAULT_REDIS_URL


def _check_nats(url: str) -> None:
    async def check() -> None:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=3)
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()

    asyncio.run(check())


def require_nats() -> str:
    """The NATS URL (JetStream enabled), or skip the test, or fail it under ``CI=true``."""
    return _require("NATS", nats_url(), _check_nats)


def require_redis() -> str:
    """The Redis URL, or skip the test, or fail it under ``CI=true``."""
    return _require("Redis", redis_url(), lambda url: redis.Redis.from_url(url).ping())


Arrived = dict[str, tuple[str, dict[str, Any], Any]]


class NatsStream:
    """A JetStream stream of the test's own, bound to ``<prefix>.>``."""

    def __init__(self, url: str, **config: Any) -> None:
        self.url = url
        suffix = uuid.uuid4().hex[:10]
        self.name = f"NATSREDIS23_{suffix.upper()}"
        self.prefix = f"natsredis23.{suffix}"
        self._run(self._create(config))

    def _run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def _create(self, config: dict[str, Any]) -> None:
        nc = await nats.connect(self.url)
        try:
            await nc.jetstream().add_stream(name=self.name, subjects=[f"{self.prefix}.>"], **config)
        finally:
            await nc.close()

    def subject(self, topic: str = "created") -> str:
        """A subject this stream takes."""
        return f"{self.prefix}.{topic}"

    def messages(self) -> list[nats.js.api.RawStreamMsg]:
        """Every message the stream holds, in stream order."""

        async def fetch() -> list[nats.js.api.RawStreamMsg]:
            nc = await nats.connect(self.url)
            try:
                js = nc.jetstream()
                info = await js.stream_info(self.name)
                found = []
                for seq in range(info.state.first_seq, info.state.last_seq + 1):
                    if info.state.messages == 0:
                        break
                    found.append(await js.get_msg(self.name, seq))
                return found
            finally:
                await nc.close()

        return list(self._run(fetch()))

    def arrived(self) -> Arrived:
        """What the stream holds, by ``Nats-Msg-Id``: (subject, headers, payload)."""
        found: Arrived = {}
        for msg in self.messages():
            headers = dict(msg.headers or {})
            found[headers["Nats-Msg-Id"]] = (str(msg.subject), headers, json.loads(msg.data or b""))
        return found

    def broker(self, url: str | None = None, **options: Any) -> NatsBroker:
        """A broker publishing to this server."""
        return NatsBroker.from_url(url or self.url, **options)

    def cleanup(self) -> None:
        """Delete the stream."""

        async def delete() -> None:
            nc = await nats.connect(self.url)
            try:
                await nc.jetstream().delete_stream(self.name)
            finally:
                await nc.close()

        with contextlib.suppress(Exception):
            self._run(delete())


class RedisStreams:
    """Stream keys of the test's own under ``natsredis23.<random>.``; deleted afterwards."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"natsredis23.{uuid.uuid4().hex[:10]}"
        self.client = redis.Redis.from_url(url)

    def stream(self, topic: str = "created") -> str:
        """A stream key (and topic) of this test."""
        return f"{self.prefix}.{topic}"

    def keys(self) -> list[bytes]:
        """Every stream key of this test."""
        return sorted(self.client.scan_iter(match=f"{self.prefix}.*", count=1000))

    def entries(self, stream: str | bytes | None = None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The entries of one stream, or of all of this test's streams."""
        streams = [stream] if stream is not None else self.keys()
        found: list[tuple[bytes, dict[bytes, bytes]]] = []
        for key in streams:
            if self.client.type(key) == b"stream":
                found += self.client.xrange(key)
        return found

    def arrived(self) -> Arrived:
        """What the streams hold, by event id: (topic, headers, payload)."""
        found: Arrived = {}
        for _, fields in self.entries():
            found[fields[b"event_id"].decode()] = (
                fields[b"topic"].decode(),
                json.loads(fields[b"headers"]),
                json.loads(fields[b"payload"]),
            )
        return found

    def broker(self, url: str | None = None, **options: Any) -> RedisBroker:
        """A broker publishing to this server."""
        return RedisBroker.from_url(url or self.url, **options)

    def cleanup(self) -> None:
        """Delete this test's streams and the dedup keys of the events they hold."""
        entries = self.entries()
        dedup = [DEDUP_PREFIX + f[b"event_id"].decode() for _, f in entries if b"event_id" in f]
        for key in self.keys():
            self.client.delete(key)
        for start in range(0, len(dedup), 500):
            self.client.delete(*dedup[start : start + 500])
        self.client.close()
