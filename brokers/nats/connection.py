"""The NATS broker's connection: nats-py's client, its reply subscription, and connecting.

:func:`open_connection` connects once (the broker reconnects with its own
backoff, between batches), refusing a server that does not require TLS when
TLS was asked for, and subscribes to the connection's reply subjects.
:class:`NatsConnection` matches each JetStream answer to the message waiting
for it, and records why the connection was lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlsplit

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from outbox_core.brokers.nats.options import NatsOptions
from outbox_core.redaction import redact

log = logging.getLogger("outbox.brokers.nats")


def describe_error(exc: BaseException) -> str:
    """A short text for a nats-py error (its own ``nats:`` text, else the type), redacted."""
    text = str(exc) or repr(exc)
    return redact(text if text.startswith("nats:") else f"{type(exc).__name__}: {text}")


class NatsConnection:
    """One NATS connection and its reply subscription; lives on the broker's loop."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.client = client
        #: Reply subjects are ``prefix`` + a counter; one subscription takes them all.
        self.prefix = prefix
        #: Reply token -> the future its answer completes.
        self.waiting: dict[str, asyncio.Future[Msg]] = {}
        #: Why the connection was lost (None while it lives).
        self.lost: str | None = None
        self.lost_event = asyncio.Event()

    async def on_reply(self, msg: Msg) -> None:
        """Complete the future waiting for this answer (the subscription's callback)."""
        future = self.waiting.pop(msg.subject[len(self.prefix) :], None)
        if future is not None and not future.done():
            future.set_result(msg)

    def lose(self, reason: str) -> None:
        """Mark the connection lost (the first reason stays) and wake the batch waiting."""
        if self.lost is None:
            self.lost = reason
        self.lost_event.set()


class BestEffort:
    """Ignore any error (closing is best effort), logged at DEBUG."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        if exc[0] is not None:
            log.debug("ignored while closing: %r", exc[1])
        return True


async def open_connection(url: str, options: NatsOptions, display: str) -> NatsConnection:
    """Connect to ``url`` once and subscribe to the connection's reply subjects.

    Raises what connecting raised: the server's last error rather than
    nats-py's "no servers available".
    """
    holder: list[NatsConnection] = []
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        # Not every error ends the connection (a slow consumer does not):
        # the disconnect callback below decides, and names the last one.
        errors.append(exc)

    async def on_disconnected() -> None:
        if holder:
            why = f": {describe_error(errors[-1])}" if errors else ""
            holder[0].lose(f"connection lost{why}")

    extra: dict[str, Any] = {}
    tls = options.tls_context()
    if tls is not None:
        extra["tls"] = tls
    if options.creds is not None:
        extra["user_credentials"] = options.creds
    if tls is not None:
        await check_server_requires_tls(url, options.connect_timeout, display)
    client = Client()
    try:
        await asyncio.wait_for(
            client.connect(
                servers=[url],
                name=options.connection_name,
                # One try (nats-py counts attempts from the second): the broker
                # reconnects with its own backoff, between batches.
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                connect_timeout=max(1, round(options.connect_timeout)),
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                closed_cb=on_disconnected,
                **extra,
            ),
            2 * options.connect_timeout + 1,
        )
    except BaseException as exc:
        with BestEffort():
            await asyncio.wait_for(client.close(), 2.0)
        if isinstance(exc, nats.errors.NoServersError) and errors:
            raise errors[-1] from None  # the reason, not "no servers available"
        raise
    conn = NatsConnection(client, client.new_inbox() + ".")
    holder.append(conn)
    await client.subscribe(conn.prefix + "*", cb=conn.on_reply)
    await client.flush(timeout=max(1, round(options.connect_timeout)))
    log.info("connected to %s", display)
    return conn


async def check_server_requires_tls(url: str, timeout: float, display: str) -> None:
    """Refuse a server that does not require TLS when TLS was asked for.

    nats-py upgrades to TLS only when the server's INFO says
    ``tls_required``; otherwise it would send the credentials in clear.
    The INFO line comes first on every connection, so read it here.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 4222
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    _, _, info = line.partition(b" ")
    try:
        required = bool(json.loads(info).get("tls_required"))
    except ValueError:
        required = False
    if not required:
        raise ConnectionError(
            f"TLS was asked for, but {display} does not require TLS; not connecting in clear"
        )
