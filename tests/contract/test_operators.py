"""What an operator sees: passwords never printed, clear errors, the broker's state (issue #21)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import outbox_cli as run


@pytest.mark.parametrize("log_json", [False, True])
def test_a_broker_url_missing_its_separator_is_refused_and_masked(log_json: bool) -> None:
    flags = ["--log-json"] if log_json else []
    result = run(
        *flags, "-v", "relay", "--broker", "amqp//app:S3cr3t@rabbit:5672/%2F",
        "--db", "sqlite:///never-opened.db", "--once",
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "S3cr3t" not in output
    assert "invalid broker URL 'amqp//app:***@rabbit:5672/%2F': '://' is missing" in output
    assert "unknown broker URL scheme" not in output
    assert "relaying" not in output  # refused before anything is logged


@pytest.mark.parametrize("log_json", [False, True])
def test_a_database_url_missing_its_separator_is_refused_and_masked(log_json: bool) -> None:
    flags = ["--log-json"] if log_json else []
    db = "postgresql+psycopg//postgres:S3cr3t@127.0.0.1/test"
    for command in (["relay", "--broker", "memory://", "--once"], ["status"], ["install"]):
        result = run(*flags, "-v", *command, "--db", db)
        output = result.stdout + result.stderr
        assert result.returncode == 2, output
        assert "S3cr3t" not in output
        assert (
            "invalid database URL 'postgresql+psycopg//postgres:***@127.0.0.1/test': "
            "'://' is missing after the scheme" in output
        )


# ---------------------------------------------------------------------------
# Operator edges (item 5): the broker's state at start, status, replay


@pytest.fixture
def sqlite_db(tmp_path: Path) -> str:
    """An installed outbox table in a private SQLite file (no event in it)."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    installed = run("install", "--db", url)
    assert installed.returncode == 0, installed.stderr
    return url


def _pika_lines(stderr: str) -> list[str]:
    # text log lines are "time LEVEL logger: message"; pika's loggers are pika.*
    return [line for line in stderr.splitlines() if " pika" in line or "pika." in line]


def _healthz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_relay_probes_an_unreachable_broker_at_start(sqlite_db: str) -> None:
    from tests.contract.broker_fixtures import unused_port

    port = unused_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "outbox_core.cli", "-v", "relay", "--db", sqlite_db,
            "--broker", "amqp://guest:guest@127.0.0.1:1/", "--metrics-port", str(port),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        health: tuple[int, dict[str, Any]] = (0, {})
        while time.monotonic() < deadline:
            try:
                health = _healthz(port)
            except OSError:  # not listening yet
                health = (0, {})
            if health[0] == 503:
                break
            time.sleep(0.2)
        code, body = health
        assert code == 503, body  # no event was enqueued: the probe at start found it
        assert body["broker"]["up"] is False
        assert "127.0.0.1:1" in body["broker"]["error"]
        time.sleep(4)  # several probes with backoff: still one outage line
        assert proc.poll() is None, "the relay keeps running while the broker is down"
        assert _healthz(port)[0] == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    outage = [line for line in err.splitlines() if "broker unavailable" in line]
    assert len(outage) == 1, err
    assert "broker unavailable at start" in outage[0]
    assert _pika_lines(err) == [], err
    assert "guest:guest" not in out + err


def test_status_exits_1_when_the_broker_is_down_in_one_line(sqlite_db: str) -> None:
    result = run("status", "--db", sqlite_db, "--broker", "amqp://guest:guest@127.0.0.1:1/")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DOWN" in result.stdout
    assert _pika_lines(result.stderr) == [], result.stderr
    as_json = run(
        "status", "--db", sqlite_db, "--json", "--broker", "amqp://guest:guest@127.0.0.1:1/"
    )
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["broker"]["up"] is False


@pytest.mark.needs_server
def test_status_takes_broker_options_and_probes_that_exchange(sqlite_db: str) -> None:
    from tests.contract.broker_fixtures import require_rabbitmq

    url = require_rabbitmq()
    missing = f"no-such-exchange-{uuid.uuid4().hex[:8]}"
    down = run(
        "status", "--db", sqlite_db, "--broker", url,
        "--broker-option", f"exchange={missing}", "--broker-option", "declare_exchange=false",
    )  # fmt: skip
    assert down.returncode == 1, down.stdout + down.stderr
    assert f"DOWN: checking exchange '{missing}'" in down.stdout
    assert "NOT_FOUND" in down.stdout
    # As the README shows it: the exchange the relay publishes to (its default, "outbox").
    up = run("status", "--db", sqlite_db, "--broker", url, "--broker-option", "exchange=outbox")
    assert up.returncode == 0, up.stdout + up.stderr
    assert ": up" in up.stdout
    bad = run("status", "--db", sqlite_db, "--broker", url, "--broker-option", "exchange")
    assert bad.returncode == 2 and "--broker-option takes KEY=VALUE" in bad.stderr


def test_replay_without_a_selector_names_its_flags(sqlite_db: str) -> None:
    result = run("replay", "--db", sqlite_db)
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    for flag in ("--id", "--topic", "--key", "--all"):
        assert flag in error, error
    assert "all=True" not in error
    assert run("replay", "--db", sqlite_db, "--all").stdout.strip() == "replayed 0 dead events"
