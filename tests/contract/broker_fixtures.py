"""Test doubles for the broker contract suite: a webhook receiver, a TCP proxy, events.

``WebhookServer`` is a real HTTP server (``ThreadingHTTPServer`` on
127.0.0.1, random port) that verifies Standard Webhooks signatures with
:func:`outbox_core.brokers.signing.verify_signature` and answers per event as told.

``TcpProxy`` forwards a local port to RabbitMQ and can cut every connection
or swallow the broker's replies, to exercise connection loss and confirm
timeouts against the real server.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pytest

from outbox_core.brokers.rabbitmq import RabbitMQBroker
from outbox_core.brokers.signing import WebhookVerificationError, verify_signature
from outbox_core.message import Event

# Re-exported: the broker tests import them from here.
from outbox_core.testing.broker_contract import TRACEPARENT as TRACEPARENT
from outbox_core.testing.broker_contract import make_event as make_event

DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

_ids = itertools.count(1)


def unused_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ---------------------------------------------------------------------------
# RabbitMQ availability (CI rule)


def rabbitmq_url() -> str:
    """The RabbitMQ under test: ``OUTBOX_TEST_RABBITMQ_URL`` or the local default."""
    return os.environ.get("OUTBOX_TEST_RABBITMQ_URL") or DEFAULT_RABBITMQ_URL


def in_ci() -> bool:
    """True when ``CI=true``: required services must be there."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


_reachable: dict[str, str | None] = {}


def require_rabbitmq() -> str:
    """The RabbitMQ URL, or skip the test, or fail it under ``CI=true``."""
    import pika

    url = rabbitmq_url()
    if url not in _reachable:
        try:
            params = pika.URLParameters(url)
            params.socket_timeout = 3
            params.stack_timeout = 5
            params.connection_attempts = 1
            pika.BlockingConnection(params).close()
            _reachable[url] = None
        except Exception as exc:
            _reachable[url] = repr(exc)[:300]
    problem = _reachable[url]
    if problem is not None:
        host = urlsplit(url.replace("amqp", "http", 1)).netloc.rpartition("@")[2]
        message = f"RabbitMQ at {host} is unreachable ({problem})"
        if in_ci():
            pytest.fail(f"{message}; CI=true requires it", pytrace=False)
        pytest.skip(message)
    return url


# ---------------------------------------------------------------------------
# Webhook receiver


@dataclass
class Rule:
    """How the webhook server answers one event."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: str = "ok"
    delay: float = 0.0


@dataclass
class Received:
    """One request the webhook server got."""

    event_id: str
    headers: dict[str, str]
    body: bytes
    json: Any
    status: int
    at: float


class WebhookServer:
    """A real HTTP receiver that verifies signatures and answers as scripted."""

    def __init__(self, secret: str | None = SECRET) -> None:
        self.secret = secret
        self.rules: dict[str, Rule] = {}
        self.default = Rule()
        self.requests: list[Received] = []
        self.bad_signatures: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    server.handle(self)
                finally:
                    with server.lock:
                        server.in_flight -= 1

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128  # listen backlog: the broker opens many connections

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Where the server listens."""
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/hooks/outbox?tenant=1"

    def start(self) -> WebhookServer:
        """Serve in a background thread."""
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(
        self, event: Event, status: int, *, body: str = "", delay: float = 0.0, **headers: str
    ) -> None:
        """Answer ``status`` (with headers, e.g. ``retry_after="7"``) for ``event``."""
        self.rules[event.event_id] = Rule(
            status, {k.replace("_", "-"): v for k, v in headers.items()}, body, delay
        )

    def accepted(self) -> dict[str, Received]:
        """Requests answered 2xx, by event id."""
        with self.lock:
            return {r.event_id: r for r in self.requests if 200 <= r.status < 300}

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        """Verify, record and answer one POST."""
        length = int(request.headers.get("content-length") or 0)
        body = request.rfile.read(length)
        headers = {k.lower(): v for k, v in request.headers.items()}
        if self.secret is not None:
            try:
                verify_signature(self.secret, request.headers, body)
            except WebhookVerificationError as exc:
                with self.lock:
                    self.bad_signatures.append(str(exc))
                self.reply(request, 401, {}, f"bad signature: {exc}")
                return
        event_id = headers.get("webhook-id", "")
        rule = self.rules.get(event_id, self.default)
        if rule.delay:
            time.sleep(rule.delay)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        with self.lock:
            self.requests.append(
                Received(event_id, headers, body, parsed, rule.status, time.monotonic())
            )
        self.reply(request, rule.status, rule.headers, rule.body)

    @staticmethod
    def reply(
        request: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: str
    ) -> None:
        """Send a complete response (keep-alive friendly)."""
        data = body.encode()
        try:
            request.send_response(status)
            for name, value in headers.items():
                request.send_header(name, value)
            request.send_header("content-type", "text/plain; charset=utf-8")
            request.send_header("content-length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)
        except OSError:  # the client gave up (timeout test)
            pass


# ---------------------------------------------------------------------------
# TCP proxy in front of RabbitMQ


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; can cut connections or swallow replies."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port: int = self.listener.getsockname()[1]
        #: when True, bytes from the broker are read and dropped (no confirms arrive)
        self.swallow_replies = False
        #: when True, every new connection is closed at once (the broker is down)
        self.refusing = False
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        self.running = True
        self.accepted = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def url(self, base_url: str) -> str:
        """``base_url`` with host and port replaced by the proxy's."""
        parts = urlsplit(base_url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = (userinfo + "@" if userinfo else "") + f"127.0.0.1:{self.port}"
        return parts._replace(netloc=netloc).geturl()

    def _accept(self) -> None:
        while self.running:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.refusing:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        sockets = [client, upstream]
        try:
            while True:
                readable, _, _ = select.select(sockets, [], [], 0.2)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        upstream.sendall(data)
                    elif not self.swallow_replies:
                        client.sendall(data)
        except OSError:
            return
        finally:
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def cut(self) -> None:
        """Reset every open connection (as a crashed broker or network would)."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def down(self) -> None:
        """The broker goes down: open connections are cut and new ones closed at once."""
        self.refusing = True
        self.cut()

    def up(self) -> None:
        """The broker is back: connections go through again."""
        self.refusing = False

    def close(self) -> None:
        """Stop accepting and cut everything."""
        self.running = False
        self.listener.close()
        self.cut()
        self.thread.join(timeout=2)


# ---------------------------------------------------------------------------
# A RabbitMQ exchange and queue of the test's own

BOUND = "contract.#"  # the test queue's binding: other topics are unroutable


class RabbitState:
    """A unique exchange and a queue bound to it with ``contract.#``."""

    def __init__(self, url: str) -> None:
        self.url = url
        suffix = uuid.uuid4().hex[:10]
        self.exchange = f"test.outbox.{suffix}"
        self.queue = f"test.outbox.q.{suffix}"
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()
        self.channel.exchange_declare(self.exchange, "topic", durable=True)
        self.channel.queue_declare(self.queue, durable=False, arguments={"x-queue-type": "classic"})
        self.channel.queue_bind(self.queue, self.exchange, BOUND)
        self.seen: dict[str, tuple[str, dict[str, Any], Any]] = {}
        self.messages: list[tuple[Any, bytes]] = []

    def drain(self) -> list[tuple[Any, bytes]]:
        """Fetch every message now in the queue."""
        fetched = []
        while True:
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                break
            fetched.append((properties, body))
            self.messages.append((properties, body))
        return fetched

    def arrived(self) -> dict[str, tuple[str, dict[str, Any], Any]]:
        """Every message received so far, by message id."""
        for properties, body in self.drain():
            headers = dict(properties.headers or {})
            payload = json.loads(body) if properties.content_type == "application/json" else body
            self.seen[properties.message_id] = (properties.type, headers, payload)
        return dict(self.seen)

    def broker(self, url: str | None = None, **options: Any) -> RabbitMQBroker:
        """A broker publishing to this exchange."""
        options.setdefault("exchange", self.exchange)
        broker = RabbitMQBroker.from_url(url or self.url, **options)
        assert isinstance(broker, RabbitMQBroker)
        return broker

    def cleanup(self) -> None:
        """Delete the queue and the exchange."""
        try:
            if self.connection.is_closed:
                self.connection = pika.BlockingConnection(pika.URLParameters(self.url))
            channel = self.connection.channel()
            channel.queue_delete(self.queue)
            channel.exchange_delete(self.exchange)
            self.connection.close()
        except pika.exceptions.AMQPError:
            pass
