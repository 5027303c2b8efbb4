"""A running ``outbox relay --metrics-port`` exposes correct metrics after a known workload."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from outbox_core import Outbox
from tests.contract.broker_fixtures import unused_port

PUBLISHER = """
from outbox_core import Outcome

def publish(events):
    return [Outcome.reject("no route") if e.topic == "bad" else Outcome.ok() for e in events]
"""


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def test_metrics_and_health_of_a_running_relay(outbox: Outbox, db_url: str, tmp_path: Path) -> None:
    (tmp_path / "metrics_publisher.py").write_text(PUBLISHER)
    with outbox.engine.begin() as conn:
        for i in range(7):
            outbox.enqueue(conn, "order.created", {"i": i}, key=f"k{i % 2}")
        outbox.enqueue(conn, "bad", {"i": 99})
        outbox.enqueue(conn, "later", {"i": 100}, delay=3600)
    port = unused_port()
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox_core.cli",
            "relay",
            "--db",
            db_url,
            "--table",
            outbox.table.name,
            "--broker",
            "python://metrics_publisher:publish",
            "--metrics-port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            try:
                text = scrape(base + "/metrics")
                # The table gauges are cached for 5 s: wait for a reading taken
                # after the batch was settled (one taken between claim and
                # settle already shows 1 pending, but no dead event yet).
                published = 'outbox_events_published_total{topic="order.created"} 7.0' in text
                fresh = "outbox_pending_events 1.0" in text and "outbox_dead_events 1.0" in text
                if published and fresh:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        assert sample(text, "outbox_events_published_total", 'topic="order.created"') == 7
        assert sample(text, "outbox_events_dead_total", 'topic="bad"') == 1
        assert sample(text, "outbox_publish_failures_total", 'reason="reject"') == 1
        assert sample(text, "outbox_pending_events") == 1  # the delayed one
        assert 3500 > sample(text, "outbox_oldest_pending_age_seconds") >= 0
        assert sample(text, "outbox_dead_events") == 1
        assert sample(text, "outbox_publish_latency_seconds_count") == 7
        assert sample(text, "outbox_claim_duration_seconds_count") >= 1
        assert sample(text, "outbox_mark_duration_seconds_count") >= 1
        assert sample(text, "outbox_batch_size_sum") == 8
        with urllib.request.urlopen(base + "/healthz", timeout=5) as response:
            assert response.status == 200
            health = json.loads(response.read())
        assert health["status"] == "ok"
        assert health["database"] == "ok"
        assert health["broker"]["up"] is True
        # The table vanishes under the running relay: /healthz says so (503, with the reason).
        outbox.table.drop(outbox.engine)
        status, body = 200, ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and status == 200:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=5) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status, body = exc.code, exc.read().decode()
            time.sleep(0.2)
        assert status == 503
        assert f"table '{outbox.table.name}' not found" in json.loads(body)["database"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]


def test_status_reports_rates(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        for i in range(3):
            outbox.enqueue(conn, "t", {"i": i})
    status = outbox.status()
    assert status.created_last_minute == 3
    assert status.sent_last_minute == 0


@pytest.mark.parametrize("flag", ["--json", None])
def test_status_watch_refreshes(outbox: Outbox, db_url: str, flag: str | None) -> None:
    args = [sys.executable, "-m", "outbox_core.cli", "status", "--db", db_url]
    args += ["--table", outbox.table.name, "--watch", "0.2"] + ([flag] if flag else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    # Ready when it has refreshed once: two reports printed (not after a fixed
    # sleep: on a loaded machine the process may still be importing).
    shown = ""
    while shown.count("pending") < 2:
        line = proc.stdout.readline()
        assert line, f"status --watch ended early: {proc.wait()} {proc.stderr.read()}"
        shown += line
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    assert proc.returncode == 0
