"""Fixtures of the dashboard's browser tests: a table, a running ``outbox dashboard``, Chromium.

The dashboard runs as the docs show it, ``outbox dashboard --db URL --table T
--port N`` in a process of its own (the token in ``OUTBOX_DASHBOARD_TOKEN``),
and is ready when ``/healthz`` answers. The browser is Debian's Chromium
driven by Playwright (its own browser download is not used).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright

from outbox_core import Outbox
from outbox_core.message import State
from tests.conftest import BACKENDS, require_system_tool, server_url, unavailable
from tests.contract.broker_fixtures import unused_port

#: The ``outbox`` script of this virtual environment.
OUTBOX = Path(sys.executable).with_name("outbox")
TOKEN_ENV = "OUTBOX_DASHBOARD_TOKEN"
#: What each test waits for at most (page loads, a refresh, a server's start).
WAIT_MS = 15_000
#: Markup that would run if a page inserted user content as HTML.
SCRIPT = "<script>window.__xss=1</script>"
IMG = '<img src=x onerror="window.__xss=1">'


def reachable_url(backend: str) -> str:
    """The test server of ``backend``: skip where it is not run, fail under CI=true when down."""
    if backend not in BACKENDS:
        pytest.skip(f"{backend} is not in OUTBOX_TEST_BACKENDS")
    url = server_url(backend)
    if url is None:
        pytest.skip(f"{backend}: set OUTBOX_TEST_{backend.upper()}_URL to run")
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:
        unavailable(backend, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    finally:
        engine.dispose()
    return url


@contextlib.contextmanager
def new_outbox(url: str) -> Iterator[Outbox]:
    """An installed outbox on a table of its own, dropped afterwards."""
    outbox = Outbox(url, table=f"obx_dash_{uuid.uuid4().hex[:10]}")
    outbox.install()
    try:
        yield outbox
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def add(
    outbox: Outbox,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> int:
    """Enqueue one event (committed) and return its row id, which the pages show."""
    with outbox.engine.begin() as conn:
        event_id = outbox.enqueue(conn, topic=topic, payload=payload, key=key, headers=headers)
        found = conn.execute(
            sa.select(outbox.table.c.id).where(outbox.table.c.event_id == event_id)
        )
        return int(found.scalar_one())


def set_state(outbox: Outbox, ids: list[int], state: State, error: str | None = None) -> None:
    """Make events leased or dead, as a relay would have left them."""
    t = outbox.table
    values: dict[str, Any] = {"state": int(state)}
    if state == State.DEAD:
        values.update(attempts=3, last_error=error)
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.id.in_(ids)).values(**values))


def add_dead(outbox: Outbox, topic: str, error: str, *, key: str | None = None) -> int:
    """One dead event with ``error`` as its last error."""
    event = add(outbox, topic, {"topic": topic}, key=key)
    set_state(outbox, [event], State.DEAD, error)
    return event


def states(outbox: Outbox, ids: list[int]) -> dict[int, State]:
    """Each event's state, read from the table."""
    t = outbox.table
    with outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.id, t.c.state).where(t.c.id.in_(ids))).all()
    return {int(i): State(s) for i, s in rows}


def new_token() -> str:
    """An operator token (long enough for the dashboard)."""
    return secrets.token_urlsafe(24)


@dataclass
class Dashboard:
    """A running ``outbox dashboard`` process."""

    base: str
    token: str | None
    output: Path

    def url(self, path: str) -> str:
        """The absolute URL of ``path``."""
        return self.base + path

    def http(self) -> httpx.Client:
        """A plain HTTP client of the dashboard (no browser, no cookies kept across runs)."""
        return httpx.Client(base_url=self.base, timeout=10)


def wait_ready(proc: subprocess.Popen[bytes], base: str, output: Path) -> None:
    """Poll ``/healthz`` until it answers; fail at once if the process ends."""
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            pytest.fail(f"outbox dashboard exited with {proc.returncode}: {output.read_text()}")
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"outbox dashboard did not answer /healthz: {output.read_text()}")
        time.sleep(0.1)  # the poll's pace, not a wait for something to happen


@contextlib.contextmanager
def serve(
    db_url: str, table: str, workdir: Path, *, token: str | None = None, args: tuple[str, ...] = ()
) -> Iterator[Dashboard]:
    """Run ``outbox dashboard`` on ``table`` until the block ends (read-only without a token)."""
    port = unused_port()
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token is not None:
        env[TOKEN_ENV] = token
    command = [str(OUTBOX), "dashboard", "--db", db_url, "--table", table, "--port", str(port)]
    output = workdir / f"dashboard-{port}.log"
    with output.open("wb") as sink:
        proc = subprocess.Popen([*command, *args], env=env, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, output)
        yield Dashboard(base, token, output)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def pg_url() -> str:
    """PostgreSQL's test database."""
    return reachable_url("postgresql")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium (Debian's), one per module."""
    path = require_system_tool("chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class Watch:
    """What a page reported: script errors, console errors (CSP violations), dialogs."""

    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def console(self, message: ConsoleMessage) -> None:
        """Keep a console message of type error."""
        if message.type == "error":
            self.errors.append(f"console: {message.text} ({message.location.get('url')})")


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a fresh browser context (no cookies from other tests)."""
    context = browser.new_context()
    context.set_default_timeout(WAIT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def watch(page: Page) -> Watch:
    """Errors and dialogs of ``page`` from now on."""
    seen = Watch()
    page.on("pageerror", lambda error: seen.errors.append(f"pageerror: {error}"))
    page.on("console", seen.console)

    def dialog(d: Any) -> None:
        seen.dialogs.append(f"{d.type}: {d.message}")
        d.dismiss()

    page.on("dialog", dialog)
    return seen


def sign_in(page: Page, dashboard: Dashboard, token: str | None = None) -> None:
    """Sign in at ``/login`` with the dashboard's token (or ``token``)."""
    page.goto(dashboard.url("/login"))
    page.fill("#token", token or dashboard.token or "")
    with page.expect_navigation():
        page.click("#sign-in")
