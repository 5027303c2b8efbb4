"""What an operator sees: passwords never printed, clear errors, the broker's state (issue #21)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )


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
