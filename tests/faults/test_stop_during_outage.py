"""A relay stopped while its database is down says so in a line, never a traceback.

On a private PostgreSQL the test starts and stops itself: ``outbox relay`` runs,
the server goes down, the relay reports the outage, then SIGTERM: the relay
exits 0 and what it logs from the signal on is a few plain lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.faults.private_servers import PrivatePostgres, private_server

pytestmark = pytest.mark.needs_server


@pytest.fixture
def server() -> Iterator[PrivatePostgres]:
    with private_server("postgresql") as started:
        assert isinstance(started, PrivatePostgres)
        yield started


def _wait_for(proc: subprocess.Popen[str], needle: str, seen: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            return
    pytest.fail(f"the relay ended before {needle!r}:\n{''.join(seen)}")


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_a_relay_stopped_during_a_database_outage_says_so_in_a_line(
    server: PrivatePostgres, ordered: bool
) -> None:
    outbox = [sys.executable, "-m", "outbox_core.cli"]
    subprocess.run([*outbox, "install", "--db", server.url], check=True, capture_output=True)
    args = [*outbox, "relay", "--db", server.url, "--broker", "memory://outage"]
    args += ["--ordered"] if ordered else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    seen: list[str] = []
    try:
        _wait_for(proc, "now owns partitions" if ordered else "started", seen)
        server.stop("immediate")
        _wait_for(proc, "database unavailable", seen)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(seen) + rest
    assert "Traceback" not in rest, rest
    assert len(rest.splitlines()) <= 4, rest
    assert "stopped" in rest
