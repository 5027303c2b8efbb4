"""The NATS broker against private ``nats-server`` processes this test starts and stops.

The shared server has no TLS, no password and no monitoring port, and is
never reconfigured, so the options that need them run here: ``tls_ca`` with
a self-signed certificate (``openssl``), user and password from the URL (and
a wrong one: an outage, masked), ``connection_name`` (read back from the
server's ``/connz``) and ``creds`` (a file the server does not trust: refused;
a server in operator mode with real JWTs is not set up here).
``nats-server`` or ``openssl`` missing skips these tests, and fails them under
``CI=true``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from outbox_core.brokers.nats import NatsBroker
from outbox_core.message import OutcomeKind
from tests.contract.broker_fixtures import make_event, unused_port
from tests.contract.stream_fixtures import require_tool

pytestmark = pytest.mark.needs_server

OK, DOWN = OutcomeKind.OK, OutcomeKind.UNAVAILABLE


class PrivateNats:
    """A ``nats-server -js`` of the test's own, on free ports, stopped afterwards."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.port = unused_port()
        self.monitor = unused_port()
        command = [require_tool("nats-server"), "-js", "-sd", str(folder / "js")]
        command += ["-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor), *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/healthz", timeout=1)
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise AssertionError("the private nats-server did not start")

    def connz(self) -> list[dict[str, object]]:
        """The server's open connections (monitoring endpoint)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/connz", timeout=5) as r:
            return list(json.load(r).get("connections") or [])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def add_stream(url: str, subject: str, **connect: object) -> None:
    async def add() -> None:
        nc = await nats.connect(url, **connect)  # type: ignore[arg-type]
        try:
            await nc.jetstream().add_stream(name="PRIVATE", subjects=[subject])
        finally:
            await nc.close()

    asyncio.run(add())


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [require_tool("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_server(tmp_path: Path, certificate: tuple[Path, Path]) -> Iterator[PrivateNats]:
    cert, key = certificate
    server = PrivateNats(tmp_path, "--tls", "--tlscert", str(cert), "--tlskey", str(key))
    yield server
    server.stop()


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[PrivateNats]:
    server = PrivateNats(tmp_path, "--user", "relay", "--pass", "s3cret")
    yield server
    server.stop()


def test_tls_ca_verifies_the_server(
    tls_server: PrivateNats, certificate: tuple[Path, Path]
) -> None:
    import ssl

    cert, _ = certificate
    url = f"nats://127.0.0.1:{tls_server.port}"
    add_stream(url, "tls.>", tls=ssl.create_default_context(cafile=str(cert)))
    broker = NatsBroker.from_url(url, tls_ca=str(cert))
    try:
        assert [o.kind for o in broker.publish([make_event("tls.created")])] == [OK]
    finally:
        broker.close()
    # Without the CA the certificate is not trusted: an outage, not a publish in clear.
    untrusting = NatsBroker.from_url(url, tls="true", connect_timeout=2)
    try:
        [outcome] = untrusting.publish([make_event("tls.created")])
    finally:
        untrusting.close()
    assert outcome.kind is DOWN
    assert "certificate" in (outcome.error or "").lower()


def test_url_credentials_and_connection_name(password_server: PrivateNats) -> None:
    url = f"nats://relay:s3cret@127.0.0.1:{password_server.port}"
    add_stream(url, "auth.>")
    broker = NatsBroker.from_url(url, connection_name="billing relay")
    try:
        assert [o.kind for o in broker.publish([make_event("auth.created")])] == [OK]
        names = [c.get("name") for c in password_server.connz()]
        assert "billing relay" in names
    finally:
        broker.close()
    wrong = NatsBroker.from_url(
        f"nats://relay:wr0ng-pass@127.0.0.1:{password_server.port}", connect_timeout=2
    )
    try:
        [outcome] = wrong.publish([make_event("auth.created")])
        problem = wrong.probe()
    finally:
        wrong.close()
    assert outcome.kind is DOWN
    assert "authorization" in (outcome.error or "").lower()
    for text in (outcome.error or "", problem or "", repr(wrong)):
        assert "wr0ng-pass" not in text


def test_creds_file_is_handed_to_the_client(password_server: PrivateNats, tmp_path: Path) -> None:
    creds = tmp_path / "broken.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\nnot a jwt\n------END NATS USER JWT------\n")
    broker = NatsBroker.from_url(
        f"nats://127.0.0.1:{password_server.port}", creds=str(creds), connect_timeout=2
    )
    try:
        [outcome] = broker.publish([make_event("auth.created")])
    finally:
        broker.close()
    # nats-py read the file and presented its JWT, which this server does not trust.
    assert outcome.kind is DOWN
    assert "Authorization Violation" in (outcome.error or "")
