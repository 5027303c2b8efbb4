"""The ``outbox`` command end to end, as subprocesses, per database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State

PUBLISHER = """
import os, time
from pathlib import Path

def publish(events):
    Path(os.environ["PUBLISH_STARTED"]).touch()
    time.sleep(float(os.environ.get("PUBLISH_SECONDS", "0")))
    with open(os.environ["PUBLISH_LOG"], "a") as f:
        for e in events:
            f.write(e.event_id + "\\n")
"""


def outbox_cmd(*args: str, env: dict[str, str] | None = None, **kw: object) -> list[str]:
    return [sys.executable, "-m", "outbox_core.cli", *args]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        outbox_cmd(*args), capture_output=True, text=True, timeout=120, env=env or os.environ.copy()
    )


@pytest.fixture
def publisher(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "test_publisher.py").write_text(PUBLISHER)
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["PUBLISH_LOG"] = str(tmp_path / "published.log")
    env["PUBLISH_STARTED"] = str(tmp_path / "started")
    return env


def test_install_is_idempotent_and_status_reports_json(db_url: str, table_name: str) -> None:
    for _ in range(2):
        result = run("install", "--db", db_url, "--table", table_name)
        assert result.returncode == 0, result.stderr
    outbox = Outbox(db_url, table=table_name)
    try:
        with outbox.engine.begin() as conn:
            outbox.enqueue(conn, "t", {"a": 1})
        result = run("status", "--db", db_url, "--table", table_name, "--json")
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        assert status["counts"]["pending"] == 1
        text = run("status", "--db", db_url, "--table", table_name).stdout
        assert "pending" in text and "oldest pending" in text
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def test_relay_sigterm_finishes_the_batch_in_flight_and_exits_0(
    outbox: Outbox, db_url: str, publisher: dict[str, str]
) -> None:
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, "t", {"i": i}, key=f"k{i % 3}") for i in range(5)]
    env = dict(publisher, PUBLISH_SECONDS="1.5")
    proc = subprocess.Popen(
        outbox_cmd(
            "relay",
            "--db",
            db_url,
            "--table",
            outbox.table.name,
            "--broker",
            "python://test_publisher:publish",
            "--batch-size",
            "10",
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = Path(env["PUBLISH_STARTED"])
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert started.exists(), proc.communicate(timeout=5)
    proc.send_signal(signal.SIGTERM)  # mid-publish
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    published = Path(env["PUBLISH_LOG"]).read_text().split()
    assert sorted(published) == sorted(ids)
    t = outbox.table
    with outbox.engine.connect() as conn:
        states = conn.execute(sa.select(t.c.state)).scalars().all()
    assert states == [int(State.SENT)] * 5


def test_relay_once_masks_the_password(
    backend: str, outbox: Outbox, db_url: str, publisher: dict[str, str]
) -> None:
    if backend == "sqlite":
        pytest.skip("SQLite URLs carry no password")
    # Trust auth ignores the password on PostgreSQL; MariaDB refuses it: the
    # password must stay out of the output on the success and the error path.
    url = sa.make_url(db_url)
    with_password = url.set(password="Sekr3tPw").render_as_string(hide_password=False)
    result = run(
        "-v",
        "relay",
        "--once",
        "--db",
        with_password,
        "--table",
        outbox.table.name,
        "--broker",
        "amqp://guest:Sekr3tPw@127.0.0.1:1/%2F",
        env=publisher,
    )
    assert "Sekr3tPw" not in result.stdout + result.stderr
    assert "***" in result.stderr


def test_bad_configuration_is_one_clear_line(db_url: str, table_name: str) -> None:
    result = run("relay", "--db", db_url, "--broker", "sqs://broker:9324")
    assert result.returncode == 2
    assert "unknown broker URL scheme sqs://" in result.stderr
    assert "amqp://" in result.stderr and "Traceback" not in result.stderr
    result = run("install", "--db", db_url, "--table", "x; drop table y")
    assert result.returncode == 2
    assert "invalid table name 'x; drop table y'" in result.stderr


def test_replay_and_cleanup_commands(outbox: Outbox, db_url: str) -> None:
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {})
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(t).values(state=int(State.DEAD), last_error="boom"))
    result = run("replay", "--db", db_url, "--table", t.name, "--topic", "t")
    assert result.returncode == 0, result.stderr
    assert "replayed 1" in result.stdout
    result = run("cleanup", "--db", db_url, "--table", t.name, "--older-than", "0")
    assert result.returncode == 0, result.stderr
    assert "removed 0" in result.stdout  # the event is pending, not sent


def test_cleanup_removes_old_inbox_records(outbox: Outbox, db_url: str) -> None:
    from outbox_core import Inbox

    inbox = Inbox(outbox)
    with outbox.engine.begin() as conn:
        assert inbox.record(conn, "billing", "6f1c2a3e-9b7d-4c1a-8e2f-0a1b2c3d4e5f")
    time.sleep(0.05)
    args = ("cleanup", "--db", db_url, "--table", outbox.table.name)
    result = run(*args, "--inbox-older-than", "1h")
    assert "removed 0 inbox records" in result.stdout, result.stderr
    result = run(*args, "--inbox-older-than", "0")
    assert result.returncode == 0, result.stderr
    assert "removed 1 inbox records" in result.stdout


def test_cleanup_inbox_only_works_on_a_consumers_database(db_url: str, table_name: str) -> None:
    """``outbox cleanup --inbox-only`` on a database with the inbox table alone (consumers.md)."""
    from outbox_core import Inbox

    inbox = Inbox(db_url, table=table_name)
    inbox.install()  # the inbox table alone: no outbox table
    try:
        with inbox.outbox.engine.begin() as conn:
            assert inbox.record(conn, "billing", "6f1c2a3e-9b7d-4c1a-8e2f-0a1b2c3d4e5f")
        args = ("cleanup", "--db", db_url, "--table", table_name, "--inbox-only")
        refused = run(*args)
        assert refused.returncode == 2 and "--inbox-older-than" in refused.stderr
        result = run(*args, "--inbox-older-than", "0")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["removed 1 inbox records older than 0s"]
    finally:
        with inbox.outbox.engine.begin() as conn:
            inbox.table.drop(conn)
        inbox.dispose()


@pytest.mark.needs_server
def test_status_broker_says_whether_the_broker_answers(outbox: Outbox, db_url: str) -> None:
    from tests.contract.broker_fixtures import require_rabbitmq, unused_port

    url = require_rabbitmq()
    table = outbox.table.name
    up = run("status", "--db", db_url, "--table", table, "--broker", url)
    assert up.returncode == 0, up.stderr
    assert "broker amqp://guest:***@" in up.stdout and ": up" in up.stdout, up.stdout
    assert "last sent: -" in up.stdout
    down_url = f"amqp://guest:guest@127.0.0.1:{unused_port()}/%2F"
    down = run("status", "--db", db_url, "--table", table, "--broker", down_url, "--json")
    assert down.returncode == 1, down.stderr  # the broker is down: a script can tell
    broker = json.loads(down.stdout)["broker"]
    assert broker["up"] is False
    assert "refused" in broker["error"].lower()
    assert "guest:guest" not in down.stdout  # the password is masked


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    return lines[-1]


def test_relay_once_runs_one_cycle_and_exits_0_with_its_counts(
    outbox: Outbox, db_url: str, publisher: dict[str, str]
) -> None:
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, "t", {"i": i}) for i in range(3)]
    result = run(
        "relay", "--once", "--db", db_url, "--table", outbox.table.name,
        "--broker", "python://test_publisher:publish", env=publisher,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert (counts["claimed"], counts["sent"], counts["unavailable"]) == (3, 3, 0)
    assert sorted(Path(publisher["PUBLISH_LOG"]).read_text().split()) == sorted(ids)


def test_relay_before_install_exits_2_naming_the_table_and_the_fix(
    db_url: str, table_name: str
) -> None:
    started = time.monotonic()
    result = run("relay", "--db", db_url, "--table", table_name, "--broker", "memory://")
    error = _one_error_line(result)
    assert time.monotonic() - started < 60
    assert f"table '{table_name}' not found on" in error
    assert "run `outbox install --db" in error and f"--table {table_name}`" in error


def test_a_url_whose_port_is_not_a_number_is_one_clear_line() -> None:
    result = run("status", "--db", "postgresql+psycopg://u:pw@host:abc/db")
    error = _one_error_line(result)
    assert "invalid database URL" in error and "the port must be a number" in error
    assert "pw@" not in error


def test_a_metrics_port_in_use_is_one_clear_line(outbox: Outbox, db_url: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(
            "relay", "--db", db_url, "--table", outbox.table.name, "--broker", "memory://",
            "--metrics-port", str(port),
        )  # fmt: skip
    error = _one_error_line(result)
    assert f"--metrics-port {port}: cannot listen there" in error
